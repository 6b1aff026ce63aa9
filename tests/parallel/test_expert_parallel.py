"""Expert parallelism on the CPU (gloo): every rank's logits and tokens match the single process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import ep_scenarios
import pytest
import torch
from engine_runs import complete

from engine.loading.loader import load_model
from engine.loading.tokenizer import Tokenizer
from engine.model import expert_parallel as parallel
from engine.model.options import ModelOptions
from kernels import reference as ref

HERE = Path(__file__).parent
# The single process computes as the ranks do: on the general path (the ranks' MoE is a
# collective, so their lean CPU path never applies), not on the lean one, whose rounding may turn
# a random model's near-tie the other way.
GENERAL = ModelOptions(lean_decode=False)
TIMEOUT_S = 120
# Ranks and the single process sum the experts in a different order: rounding-level differences
# only.
MAX_REL = 1e-5


def _max_rel(ours, theirs):
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def _env():
    # One thread per rank: the ranks share this machine's cores. The workers import the tests'
    # shared modules (engine_runs) as pytest does.
    paths = [str(HERE.parent), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in paths if p))


def _run_ranks(model_dir: Path, world: int, tmp_path: Path) -> list[dict]:
    outs = [tmp_path / f"rank{r}.pt" for r in range(world)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "ep_worker.py"),
                str(model_dir),
                str(r),
                str(world),
                str(tmp_path / "store"),
                str(outs[r]),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
        )
        for r in range(world)
    ]
    try:
        logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:  # a rank stuck in a collective must not outlive the test
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r]}"
    return [torch.load(o) for o in outs]


@pytest.mark.parametrize(
    "world, variant",
    [(2, {}), (3, dict(mlp_only_layers=(1,), tie=True))],  # 3 ranks: 8 experts split 3 + 3 + 2
    ids=["2-ranks", "3-ranks-uneven-dense-layer"],
)
def test_ranks_match_single_process(checkpoint_factory, tmp_path, world, variant):
    path = checkpoint_factory(**variant)
    ranks = _run_ranks(path, world, tmp_path)
    expected = ep_scenarios.run(load_model(path, options=GENERAL), Tokenizer.from_dir(path))
    experts = load_model(path).config.num_experts
    assert [r.pop("experts") for r in ranks] == [
        len(parallel.expert_range(experts, r, world)) for r in range(world)
    ]
    for key, want in expected.items():
        if key.startswith("greedy"):
            assert all(r[key] == want for r in ranks), key
            continue
        assert _max_rel(ranks[0][key], want) < MAX_REL, key
        # The all-reduce hands every rank the same sum: the ranks agree exactly.
        assert all(torch.equal(r[key], ranks[0][key]) for r in ranks[1:]), key


def test_torchrun_entry_point_prints_rank0_completion(checkpoint_factory):
    path = checkpoint_factory()
    prompt = ep_scenarios.PROMPTS[0]
    model, tokenizer = load_model(path, options=GENERAL), Tokenizer.from_dir(path)
    # Encoded as `generate` encodes a prompt.
    expected, _ = complete(model, tokenizer, tokenizer.encode_prompt(prompt), max_tokens=16)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "engine.cli",
            "parallel",
            "--model",
            str(path),
            "--prompt",
            prompt,
            "--max-tokens",
            "16",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=_env(),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected and expected


def test_bench_on_random_weights_runs_on_uneven_ranks():
    """The multi-GPU measuring command, at a tiny shape on 3 CPU ranks (8 experts: 3 + 3 + 2)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "3",
            "-m",
            "engine.bench.expert_parallel",
            "--random-shape",
            "tiny",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=_env(),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # rank 0 alone prints
    assert report["world_size"] == 3 and [r["batch"] for r in report["results"]] == [1, 8]
    assert all(r["tok_s"] > 0 for r in report["results"])


@pytest.mark.parametrize("num_experts, world", [(8, 2), (8, 3), (5, 8), (128, 3)])
def test_expert_ranges_cover_every_expert_once(num_experts, world):
    ranges = [parallel.expert_range(num_experts, r, world) for r in range(world)]
    assert [e for rg in ranges for e in rg] == list(range(num_experts))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_local_partials_sum_to_the_whole_layer(tokens, world):
    """The per-rank MoE pieces (no process group): partials over the expert ranges add up."""
    gen = torch.Generator().manual_seed(tokens * 10 + world)
    e, k, h, inter = 8, 3, 32, 24
    x = torch.randn(tokens, h, generator=gen)
    w_gate_up = torch.randn(e, 2 * inter, h, generator=gen) / h**0.5
    w_down = torch.randn(e, h, inter, generator=gen) / inter**0.5
    ids, weights = ref.route(x, torch.randn(e, h, generator=gen), k, True)
    whole = ref.moe_float64(x, w_gate_up, w_down, ids, weights)
    for local_fn in (
        lambda *a: parallel._output_centric_local("warp_decode", *a),
        parallel._expert_centric_local,
    ):
        total = torch.zeros(tokens, h, dtype=torch.float64)
        for r in range(world):
            rg = parallel.expert_range(e, r, world)
            local = (ids >= rg.start) & (ids < rg.stop)
            total += local_fn(
                x,
                w_gate_up[rg.start : rg.stop],
                w_down[rg.start : rg.stop],
                ids - rg.start,
                weights,
                local,
            ).double()
        assert _max_rel(total, whole) < 1e-5


def test_loader_reads_only_the_local_experts(checkpoint_factory):
    path = checkpoint_factory()
    full, part = load_model(path), load_model(path, experts=range(3, 6))
    for a, b in zip(full.layers, part.layers):
        assert torch.equal(a.w_gate_up[3:6], b.w_gate_up) and torch.equal(a.w_down[3:6], b.w_down)
        assert torch.equal(a.router, b.router) and torch.equal(a.w_qkv, b.w_qkv)
