"""engine.bench.projections' checks run on the CPU (Triton's interpreter) at the tiny shape."""

import json

from engine.bench.projections import main, projection_sizes
from engine.loading.random_model import SHAPES


def test_projection_gemvs_match_float64_at_every_format(tmp_path):
    out = tmp_path / "projections.json"
    # The lm_head's 16,000 outputs take half a minute in the interpreter: the same kernel.
    args = ["--shape", "tiny", "--device", "cpu", "--rows", "3", "--projections", "qkv,o"]
    assert main([*args, "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 2 * 3
    assert all(0 < c["error"] < 1e-2 for c in cases), cases  # bf16 output rounding
    sizes = projection_sizes(SHAPES["tiny"])
    assert {(c["proj"], c["out"], c["k"]) for c in cases} == {(p, *sizes[p]) for p in ("qkv", "o")}
    assert sizes["lm_head"] == (SHAPES["tiny"]["vocab_size"], SHAPES["tiny"]["hidden_size"])


def test_the_sweep_times_a_quantized_formats_fastest_tiles_with_the_scales_moved(monkeypatch):
    """int4's fastest tiles are timed again with the scales on the partial products (the other
    placement), and a faster one is what the case stores; bf16 has no such round."""
    import torch

    from engine.bench import projections
    from kernels.bench import gpu_timing

    calls = []

    def fake_linear(x, w, **tile):
        calls.append(tile)
        return x

    def fake_time(fn):  # µs: wider stripes faster; scales after the dot faster still
        before = len(calls)
        fn()
        if len(calls) == before:  # cuBLAS
            return 100.0
        tile = calls[-1]
        return 10.0 - tile["block_n"] / 16 - (3.0 if tile.get("scale_weights") is False else 0.0)

    monkeypatch.setattr(projections, "skinny_linear", fake_linear)
    monkeypatch.setattr(gpu_timing, "graph_time_us", fake_time)
    x = torch.randn(1, 64)
    ws = projections.weights("int4", 32, 64, "cpu", 1, seed=0)
    tiles = [(16, 32, 4, 1), (32, 32, 4, 1), (64, 32, 4, 1), (64, 64, 4, 2), (16, 64, 8, 1)]
    case = projections.time_case(x, ws, "int4", tiles)
    flipped = [c for c in calls if "scale_weights" in c]
    assert len(flipped) == projections.SCALE_ROUND
    assert all(c["scale_weights"] is False for c in flipped)
    assert case["best_tile"]["scale_weights"] is False and case["best_tile"]["block_n"] == 64
    assert case["best_us"] == 10.0 - 4 - 3

    calls.clear()
    plain_ws = projections.weights("bf16", 32, 64, "cpu", 1, seed=0)
    plain = projections.time_case(x.bfloat16(), plain_ws, "bf16", tiles)
    assert "scale_weights" not in plain["best_tile"]
    assert not [c for c in calls if "scale_weights" in c]
