"""engine.bench.prefill_moe's sweep on the CPU (Triton's interpreter), its timings faked: the
order it searches in, the check that refuses a wrong candidate, and the tables it writes to."""

from quantized_layers import quantized_moe_layer

from engine.bench import prefill_moe
from kernels import fused_moe as ec

FAVOURITE = {
    "BLOCK_M": 128,
    "gate_up": prefill_moe.tile((64, 128, 4, 4)),
    "down": prefill_moe.tile((128, 128, 8, 3)),
}


def _closeness(cfg: dict) -> float:
    """Fake µs: one less for each of FAVOURITE's choices the config shares."""
    same = (cfg["BLOCK_M"] == FAVOURITE["BLOCK_M"]) + sum(
        cfg[k] == FAVOURITE[k] for k in ("gate_up", "down")
    )
    return 100.0 - same


def test_the_sweep_finds_each_choice_in_turn():
    timed = []

    def measure(cfg):
        timed.append(cfg)
        return _closeness(cfg)

    layer = quantized_moe_layer(40, 64, 32, 4, 2, "fp8", 16, seed=3)
    best, best_us, info = prefill_moe.sweep([layer], ec.PREFILL_CONFIG, measure, lambda _: None)
    assert best == FAVOURITE and best_us == 97.0
    # The base, BLOCK_M's two, FP8's scales on the weights, then each GEMM's tiles: each config
    # timed once.
    assert info["candidates"] == len(timed) <= 4 + 2 * len(prefill_moe.PREFILL_TILES)
    assert any(c["gate_up"].get("SCALE_WEIGHTS") for c in timed)
    assert len({str(c) for c in timed}) == len(timed)
    assert info["base_us"] == _closeness(ec.PREFILL_CONFIG)


def test_a_candidate_that_computes_something_else_is_never_chosen(monkeypatch):
    real = ec.fused_moe

    def wrong_for_wide_blocks(*args, config=None):
        y = real(*args, config=config)
        return -y if config["BLOCK_M"] == 128 else y

    monkeypatch.setattr(prefill_moe, "fused_moe", wrong_for_wide_blocks)
    layer = quantized_moe_layer(40, 64, 32, 4, 2, "int4", 16, seed=4)
    best, _, _ = prefill_moe.sweep([layer], ec.PREFILL_CONFIG, _closeness, lambda _: None)
    assert best["BLOCK_M"] != 128 and best["gate_up"] == FAVOURITE["gate_up"]


def test_each_format_has_its_own_table():
    names = {fmt: prefill_moe.table_name(fmt) for fmt in ("bf16", "fp8", "int4")}
    assert names["bf16"].startswith("fused_moe_H2048")
    assert names["fp8"].startswith("fused_moe_fp8_H2048")
    assert names["int4"].startswith("fused_moe_int4_H2048")
