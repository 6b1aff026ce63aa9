"""`wd-engine pull` and models named by hub repo id, against a local server that speaks the hub's
HTTP API (hub_fake.py), with the hub cache in a temporary folder (never the network, never the
user's cache): the engine's files pulled into the cache's layout, an interrupted pull continued
with a range request, checksums, refusals, offline use of the cache, and a repo id as `--model`.

The commands run as subprocesses: `huggingface_hub` reads HF_ENDPOINT, HF_HUB_CACHE and
HF_HUB_OFFLINE when it is imported."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hub_fake import ROOT, FakeHub, isolated_env, sha256, snapshot_path, wd_engine

from engine.hub.cache import missing_files, repo_id_of
from engine.hub.files import (
    UnsupportedWeights,
    engine_files,
    format_matches,
    weights_format,
)
from engine.hub.names import RepoRef, looks_like_repo_ref, parse_repo_ref
from engine.models import ModelNotFound, display_name, resolve_model

REPO = "Org/tiny-moe"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def model_folder(checkpoint_factory) -> Path:
    """A tiny Qwen3-MoE checkpoint in shards, with its index."""
    return checkpoint_factory(max_shard_size="300KB")


@pytest.fixture(scope="module")
def hub(model_folder, tmp_path_factory):
    """The fake hub with: REPO (the checkpoint, plus files the engine never reads), a Llama
    repo, and a gated copy of REPO."""
    llama = tmp_path_factory.mktemp("llama")
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (llama / "model.safetensors").write_bytes(b"\0" * 64)
    with FakeHub() as server:
        server.add_repo(
            REPO,
            model_folder,
            extra={
                "README.md": b"# tiny\n",
                "pytorch_model.bin": b"old weights",
                "original/consolidated.safetensors": b"other weights",
            },
        )
        server.add_repo("Org/llama", llama)
        server.add_repo("Org/gated", model_folder)
        server.gated.add("Org/gated")
        yield server


@pytest.fixture
def fresh(hub):
    """The hub with no stall, corruption or log left by an earlier test."""
    hub.stall_after.clear()
    hub.corrupt.clear()
    hub.log.clear()
    hub.release.clear()
    yield hub
    hub.release.set()


def snapshot(tmp_path: Path, hub: FakeHub, repo: str = REPO) -> Path:
    return snapshot_path(tmp_path, hub, repo)


# -- names, files, formats ---------------------------------------------------------------------


def test_repo_ids_and_revisions():
    assert parse_repo_ref("Qwen/Qwen3-Coder-30B-A3B-Instruct") == RepoRef(
        "Qwen/Qwen3-Coder-30B-A3B-Instruct"
    )
    ref = parse_repo_ref("Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8@refs/pr/3")
    assert ref.revision == "refs/pr/3" and str(ref).endswith("-FP8@refs/pr/3")
    for bad in ("tiny", "a/b/c", "./a/b", "/abs/path", "a--b/c", "a/b..c", "a/b@", "-a/b", "a/b-"):
        assert not looks_like_repo_ref(bad), bad
        with pytest.raises(ValueError, match="ORG/NAME"):
            parse_repo_ref(bad)


def test_only_the_files_the_engine_reads():
    listing = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
        "README.md",
        "LICENSE",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "consolidated.safetensors",
        INDEX,
        "pytorch_model.bin",
        "model.gguf",
        "original/model.safetensors",
        "onnx/model.onnx",
    ]
    shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    assert engine_files(listing, shards) == sorted(
        [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "vocab.json",
            "README.md",
            "LICENSE",
            *shards.values(),
            INDEX,
        ]
    )
    # Without an index every top-level safetensors file is the model's.
    assert "consolidated.safetensors" in engine_files(listing)


def test_the_weights_format_from_config_json():
    from engine.loading.int4 import quantization_config

    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    int4 = {"quantization_config": quantization_config(128, ["lm_head"])}
    assert weights_format(fp8) == "fp8"
    assert weights_format(int4) == "int4"
    assert weights_format({"torch_dtype": "bfloat16"}) == "bf16"
    assert weights_format({"dtype": "float32"}) == "fp32"
    assert weights_format({}) == "bf16"
    for other in ({"quant_method": "awq", "bits": 4}, {"quant_method": "gptq"}):
        with pytest.raises(UnsupportedWeights, match=other["quant_method"]):
            weights_format({"quantization_config": other})
    assert format_matches("fp32", "bf16") and format_matches("fp8", "fp8")
    assert not format_matches("bf16", "int4") and not format_matches("fp8", "bf16")


def test_model_names_resolve_to_folders(tmp_path, monkeypatch, model_folder):
    cache = tmp_path / "hub"
    # A folder is itself, a repo id missing from the cache names the pull that fetches it.
    assert resolve_model(str(model_folder), cache) == model_folder
    with pytest.raises(ModelNotFound, match="`wd-engine pull Org/absent@v2`"):
        resolve_model("Org/absent@v2", cache)
    # A repo in the cache's layout: refs/main -> snapshots/COMMIT.
    storage = cache / "models--Org--tiny-moe"
    snap = storage / "snapshots" / ("c" * 40)
    snap.mkdir(parents=True)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text("c" * 40)
    for f in model_folder.iterdir():
        (snap / f.name).symlink_to(f)
    assert resolve_model(REPO, cache) == snap
    assert resolve_model(f"{REPO}@{'c' * 40}", cache) == snap
    assert display_name(snap) == REPO and repo_id_of(snap / "config.json") == REPO
    assert display_name(model_folder) == model_folder.name
    # A shard missing: partly downloaded, with the same command to finish it.
    shard = next(snap.glob("model-*.safetensors"))
    shard.unlink()
    assert missing_files(snap) == [shard.name]
    with pytest.raises(ModelNotFound, match=f"partly downloaded .*`wd-engine pull {REPO}`"):
        resolve_model(REPO, cache)
    # A bare name: a folder under the local model folders, or the embedded model.
    models = tmp_path / "models"
    (models / "mine").mkdir(parents=True)
    (models / "mine" / "config.json").write_text("{}")
    monkeypatch.setenv("WD_ENGINE_MODEL_DIRS", str(models))
    assert resolve_model("mine", cache) == models / "mine"
    assert resolve_model("wd-coder-tiny", cache).name == "wd-coder-tiny"


# -- pull ----------------------------------------------------------------------------------------


def test_pull_fetches_the_engines_files_into_the_hub_cache(tmp_path, fresh, model_folder):
    env = isolated_env(tmp_path, fresh.url)
    done = wd_engine(env, "pull", REPO)
    assert done.returncode == 0, done.stderr
    snap = snapshot(tmp_path, fresh)
    assert done.stdout.startswith(f"{REPO}: fp32, ") and str(snap) in done.stdout
    assert f"--model {REPO}" in done.stdout
    # The hub's API: the model's info, its file listing, then the files.
    paths = [path for _, path, _ in fresh.log]
    assert paths[0] == f"/api/models/{REPO}"
    assert any(p.startswith(f"/api/models/{REPO}/tree/") for p in paths)
    # The engine's files, as they are on the hub, linked into the snapshot from blobs named as
    # the hub client names them (a weight by its sha256); nothing else fetched.
    wanted = sorted(p.name for p in model_folder.iterdir()) + ["README.md"]
    assert sorted(p.name for p in snap.iterdir()) == sorted(wanted)
    for name in wanted:
        source = (model_folder / name).read_bytes() if name != "README.md" else b"# tiny\n"
        assert (snap / name).read_bytes() == source, name
        if name.endswith(".safetensors"):
            assert (snap / name).resolve().name == sha256(source)
    gets = {path.rsplit("/", 1)[-1] for method, path, _ in fresh.log if method == "GET"}
    assert not gets & {"pytorch_model.bin", "consolidated.safetensors"}
    storage = snap.parent.parent
    assert (storage / "refs" / "main").read_text() == snap.name
    assert not list(storage.glob("blobs/*.incomplete"))
    # Pulled again: nothing is downloaded.
    fresh.log.clear()
    again = wd_engine(env, "pull", REPO)
    assert again.returncode == 0, again.stderr
    assert not [r for r in fresh.log if r[0] == "GET" and "/resolve/" in r[1]]


def test_an_interrupted_pull_continues_where_it_stopped(tmp_path, fresh, model_folder):
    env = isolated_env(tmp_path, fresh.url)
    shard = sorted(model_folder.glob("model-*.safetensors"))[-1]
    data = shard.read_bytes()
    fresh.stall_after[shard.name] = len(data) // 2
    partial = snapshot(tmp_path, fresh).parent.parent / "blobs" / f"{sha256(data)}.incomplete"
    first = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "pull", REPO],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (partial.exists() and partial.stat().st_size) and time.monotonic() < deadline:
            assert first.poll() is None, first.communicate()
            time.sleep(0.02)
        assert partial.exists() and partial.stat().st_size, "the shard's download never started"
        first.send_signal(signal.SIGINT)  # Ctrl-C
        _, err = first.communicate(timeout=30)
    finally:
        first.kill()
        fresh.release.set()
    assert first.returncode == 128 + signal.SIGINT
    assert f"interrupted; run `wd-engine pull {REPO}` again to resume" in err
    kept = partial.stat().st_size
    assert 0 < kept <= len(data) // 2
    assert not list(partial.parent.glob("*.*.incomplete")), "the hub client's temporary files"
    # The next pull asks for the rest of that shard only.
    fresh.stall_after.clear()
    fresh.log.clear()
    second = wd_engine(env, "pull", REPO)
    assert second.returncode == 0, second.stderr
    assert "of it from an interrupted pull" in second.stderr
    shard_gets = [r for r in fresh.log if r[0] == "GET" and r[1].endswith("/" + shard.name)]
    assert shard_gets == [("GET", shard_gets[0][1], f"bytes={kept}-")]
    assert (snapshot(tmp_path, fresh) / shard.name).read_bytes() == data
    assert not partial.exists()


def test_a_file_that_does_not_match_its_checksum_is_removed(tmp_path, fresh, model_folder):
    env = isolated_env(tmp_path, fresh.url)
    shard = sorted(model_folder.glob("model-*.safetensors"))[0]
    fresh.corrupt.add(shard.name)
    done = wd_engine(env, "pull", REPO)
    assert done.returncode == 1
    assert f"{shard.name} does not match the hub's sha256" in done.stderr
    assert f"run `wd-engine pull {REPO}` again" in done.stderr
    blobs = snapshot(tmp_path, fresh).parent.parent / "blobs"
    assert not list(blobs.glob(sha256(shard.read_bytes()) + "*"))
    # A small file is checked against its git blob id.
    fresh.corrupt = {"tokenizer.json"}
    done = wd_engine(env, "pull", REPO)
    assert done.returncode == 1 and "tokenizer.json does not match" in done.stderr
    assert not (snapshot(tmp_path, fresh) / "tokenizer.json").exists()
    fresh.corrupt.clear()
    assert wd_engine(env, "pull", REPO).returncode == 0


def test_pull_refusals_say_what_to_do(tmp_path, fresh):
    env = isolated_env(tmp_path, fresh.url)
    cases = [
        (["Org/absent"], "no model Org/absent at http://127.0.0.1:"),
        ([f"{REPO}@v9"], f"{REPO} has no revision 'v9'"),
        (["Org/gated"], "Org/gated is gated: accept its conditions"),
        (["Org/llama"], "Org/llama is a LlamaForCausalLM model; this engine runs"),
        (
            [REPO, "--include-format", "int4"],
            f"{REPO} holds fp32 weights, not int4: pull a repo of int4 weights, or pull this one "
            f"without --include-format and quantize it: `wd-engine quantize --to int4 {REPO} DST`",
        ),
        (["not-a-repo"], "'not-a-repo' is not a Hugging Face repo id"),
    ]
    for args, message in cases:
        done = wd_engine(env, "pull", *args)
        assert done.returncode in (1, 2) and message in done.stderr, (args, done.stderr)
    # No weight was fetched by any of them.
    assert not [r for r in fresh.log if r[0] == "GET" and r[1].endswith(".safetensors")]
    assert wd_engine(env, "pull", REPO, "--include-format", "bf16").returncode == 0


def test_offline_the_cache_serves_the_repo_id(tmp_path, fresh):
    env = isolated_env(tmp_path, fresh.url)
    assert wd_engine(env, "pull", REPO).returncode == 0
    fresh.log.clear()
    offline = dict(env, HF_HUB_OFFLINE="1")
    done = wd_engine(offline, "pull", REPO)
    assert done.returncode == 0
    assert f"HF_HUB_OFFLINE is set: {REPO} is in the cache" in done.stderr
    # A repo id as --model: the snapshot in the cache, no hub needed.
    args = ["--prompt", "def add(a, b):", "--max-tokens", "4", "--stats"]
    done = wd_engine(offline, "generate", "--model", REPO, *args)
    assert done.returncode == 0, done.stderr
    assert "[load " in done.stderr
    assert fresh.log == [], "an offline run asked the hub"
    # A hub that cannot be reached: the cache still serves a pull of what it has.
    unreachable = dict(env, HF_ENDPOINT="http://127.0.0.1:9")
    done = wd_engine(unreachable, "pull", REPO)
    assert done.returncode == 0 and "cannot be reached" in done.stderr
    done = wd_engine(unreachable, "pull", "Org/other")
    assert done.returncode == 1 and "Org/other is not in the Hugging Face cache" in done.stderr
    # A repo id that is not in the cache: one line naming the command that fetches it.
    done = wd_engine(offline, "generate", "--model", "Org/other", *args)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "wd-engine: model Org/other is not downloaded (no folder Org/other and nothing in the "
        f"Hugging Face cache {tmp_path / 'hf' / 'hub'}): fetch it with `wd-engine pull Org/other`"
    ]
