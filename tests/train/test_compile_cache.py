"""The compiled training step's artifacts, carried from one stint to the next: a second process
with an empty Inductor cache finds the first one's work, anything unreadable is a miss, and the
GPU session script brings the file back in pieces and joins them for the next start."""

import os
import subprocess
import sys
from pathlib import Path

from test_corpus_sources import _gpu_session, _packed_corpus, _write

from engine.train import compile_cache

ROOT = Path(__file__).parents[2]

# A forward and backward through torch.compile, as the trainer's step; prints its result and
# the Inductor and AOTAutograd cache counters.
STEP = """
import sys
from pathlib import Path
import torch
from torch._dynamo.utils import counters
from engine.train import compile_cache

mode, path = sys.argv[1], Path(sys.argv[2])
if mode == "load":
    print(compile_cache.load(path))
x = torch.linspace(-2.0, 3.0, 24, requires_grad=True)
loss = torch.compile(lambda t: (t.sin() * t.cos() + t).square().sum())(x)
loss.backward()
if mode == "save":
    print(compile_cache.save(path))
print("result", float(loss), float(x.grad.sum()))
hits = counters["inductor"]["fxgraph_cache_hit"], counters["aot_autograd"]["autograd_cache_hit"]
print("hits", *hits)
"""


def _step(tmp_path: Path, mode: str, cache: Path, inductor_dir: str) -> list[str]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / inductor_dir)}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", STEP, mode, str(cache)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_a_fresh_process_reuses_the_saved_compilation(tmp_path):
    cache = tmp_path / "cache" / "compile_cache.bin"
    first = _step(tmp_path, "save", cache, "inductor-a")
    assert first[0].startswith("compile cache: saved") and cache.stat().st_size > 0
    assert not cache.with_name(cache.name + ".partial").exists()
    assert first[-1] == "hits 0 0"
    # Another machine: an empty Inductor cache of its own, only the carried file.
    second = _step(tmp_path, "load", cache, "inductor-b")
    assert second[0].startswith("compile cache: loaded")
    hits = [int(n) for n in second[-1].split()[1:]]
    assert hits[0] >= 1 and hits[1] >= 1, second
    assert second[-2] == first[-2]  # the same step, bit for bit


def test_a_missing_or_damaged_cache_is_a_miss_not_an_error(tmp_path):
    assert compile_cache.load(tmp_path / "absent.bin").startswith("compile cache: none")
    damaged = tmp_path / "damaged.bin"
    damaged.write_bytes(b"\x00not a cache" * 50)
    assert "not loaded" in compile_cache.load(damaged)


def test_gpu_session_joins_this_gpus_cache_and_brings_it_back_in_a_call_of_its_own(tmp_path):
    _packed_corpus(tmp_path)
    carried = bytes(range(256)) * 300
    pieces = {
        "compile_cache-stub_gpu.bin.part00": carried[:30_000],
        "compile_cache-stub_gpu.bin.part01": carried[30_000:],
        "compile_cache-OTHER_GPU.bin.part00": b"another GPU's kernels",
    }
    for name, piece in pieces.items():
        _write(tmp_path / name, "").write_bytes(piece)
    staged = _gpu_session(tmp_path, "stage", "--clear", *pieces)
    assert staged.returncode == 0, staged.stdout + staged.stderr
    done = _gpu_session(tmp_path, "start", "p.tar.xz", "100", CALL_S="1")
    assert done.returncode == 0, done.stdout + done.stderr
    joined = tmp_path / "run" / "compile_cache.bin"
    assert joined.read_bytes() == carried  # the stub GPU's pieces alone, in order
    trainer = (tmp_path / "stub.log").read_text().splitlines()[1]
    assert f"--compile-cache {joined} " in trainer
    # The start and finish calls bring back the model; the cache comes back in its own call.
    assert not list((tmp_path / "o").glob("compile_cache*"))
    back = _gpu_session(tmp_path, "cache")
    assert back.returncode == 0, back.stdout + back.stderr
    pieces_back = sorted((tmp_path / "o").glob("compile_cache-stub_gpu.bin.part*"))
    assert pieces_back and b"".join(p.read_bytes() for p in pieces_back) == carried
