"""engine.bench.moe_formats' tuning candidates (no GPU: only the configs it would time)."""

import torch

from engine.bench.moe_formats import (
    PAIRED_TILES,
    SHAPE,
    config_key,
    crossover_entry,
    down_tiles,
    gate_up_tiles,
    paired,
    warp_candidates,
)
from kernels import warp_decode
from kernels.quant import FP8_BLOCKS, INT4_GROUPS, PLAIN, KernelWeight

STORED = {
    "gate_up": {"BLOCK_I": 8, "BLOCK_H": 128, "num_warps": 4},
    "down": {"BLOCK_H": 8, "BLOCK_I": 128, "num_warps": 4, "pdl": True, "preload": True},
}
BYTES_PER_VALUE = {"bf16": 2.0, "fp8": 1.0, "int4": 0.5}


def step_bytes(tile: dict, fmt: str, rows: str, cols: str) -> float:
    return tile[rows] * tile[cols] * BYTES_PER_VALUE[fmt]


def test_narrow_formats_try_steps_as_large_as_bf16s():
    widest_bf16 = max(step_bytes(t, "bf16", "BLOCK_I", "BLOCK_H") for t in gate_up_tiles("bf16"))
    for fmt in ("fp8", "int4"):
        widest = max(step_bytes(t, fmt, "BLOCK_I", "BLOCK_H") for t in gate_up_tiles(fmt))
        assert widest >= widest_bf16, fmt
        assert len(gate_up_tiles(fmt)) > len(gate_up_tiles("bf16"))
        assert len(down_tiles(fmt)) > len(down_tiles("bf16"))


def kernel_weights(fmt: str) -> tuple:
    """The gate/up and down KernelWeights of SHAPE's layer in a format (no tensors)."""
    none = torch.empty(0)
    consts = {
        "bf16": (PLAIN, 1, 1, 1),
        "fp8": (FP8_BLOCKS, 128, 128, 1),
        "int4": (INT4_GROUPS, 1, 128, 8),
    }[fmt]
    return (KernelWeight(none, none, *consts),) * 2


def test_first_round_varies_one_kernel_at_a_time():
    weights = kernel_weights("int4")
    candidates = warp_candidates("int4", STORED, weights)
    assert candidates[0] == STORED
    keys = [config_key(c, weights) for c in candidates]
    assert len(keys) == len(set(keys))  # no kernel timed twice
    for cfg in candidates[1:]:
        assert cfg["gate_up"] == STORED["gate_up"] or cfg["down"] == STORED["down"]
    assert {str(c["gate_up"]) for c in candidates} == {
        str(t) for t in gate_up_tiles("int4") + [STORED["gate_up"]]
    }
    assert {str(c["down"]) for c in candidates} == {
        str(t) for t in down_tiles("int4") + [STORED["down"]]
    }


def test_configs_that_run_the_same_kernel_are_timed_once():
    """bf16 at k = 8 with 8 rows: a preload of 512 or 1024 columns is cut to 256 by the
    register budget, so the two configs run one kernel."""
    weights = kernel_weights("bf16")
    wide = [
        {"gate_up": STORED["gate_up"], "down": {**STORED["down"], "preload": cols}}
        for cols in (512, 1024)
    ]
    assert config_key(wide[0], weights) == config_key(wide[1], weights)
    candidates = warp_candidates("bf16", STORED, weights)
    assert wide[0] in candidates and wide[1] not in candidates


def test_second_round_pairs_the_fastest_tiles_not_yet_timed():
    weights = kernel_weights("int4")
    first = warp_candidates("int4", STORED, weights)
    # Times that rank the first round in reverse order of the list.
    timed = sorted(((float(len(first) - n), c) for n, c in enumerate(first)), key=lambda t: t[0])
    fastest = {
        kernel: list({str(c[kernel]): c[kernel] for _, c in timed}.values())[:PAIRED_TILES]
        for kernel in ("gate_up", "down")
    }
    pairs = paired(timed, first, weights)
    expected = [
        {"gate_up": g, "down": d}
        for g in fastest["gate_up"]
        for d in fastest["down"]
        if {"gate_up": g, "down": d} not in first
    ]
    assert pairs == expected and len(pairs) >= PAIRED_TILES * (PAIRED_TILES - 1)


def test_int4_down_tiles_run_as_named():
    """The tile a candidate names is the tile that runs: the register budget never halves it."""
    h, i, k = SHAPE["hidden"], SHAPE["inter"], SHAPE["top_k"]
    _, w = kernel_weights("int4")
    for tile in down_tiles("int4"):
        _, block_h, block_i = warp_decode.down_launch_tiles(tile, w, h, i, k)
        assert (block_h, block_i) == (tile["BLOCK_H"], tile["BLOCK_I"]), tile


def test_int4_gate_up_tiles_run_as_named():
    h, i = SHAPE["hidden"], SHAPE["inter"]
    w, _ = kernel_weights("int4")
    for tile in gate_up_tiles("int4"):
        assert warp_decode.gate_up_launch_tiles(tile, w, h, i) == (
            tile["BLOCK_I"],
            tile["BLOCK_H"],
        ), tile


def _row(batch, warp, ec):
    return {"batch": batch, "warp_decode_us": warp, "expert_centric_us": ec}


def test_a_tune_at_some_batches_keeps_the_same_devices_other_crossover_batches():
    """A run timing batches 1 and 8 must not drop the dispatcher's measured winners at 16-64."""
    earlier = crossover_entry(
        None,
        "H100",
        128,
        8,
        "fp8",
        [_row(1, 21.8, 32.8), _row(8, 108.9, 108.7), _row(16, 198.2, 168.8)],
    )
    assert earlier["winners"] == {"1": "warp_decode", "8": "expert_centric", "16": "expert_centric"}
    now = crossover_entry(
        earlier, "H100", 128, 8, "fp8", [_row(1, 17.5, 32.5), _row(8, 87.5, 105.3)]
    )
    assert now["winners"] == {"1": "warp_decode", "8": "warp_decode", "16": "expert_centric"}
    assert now["us_per_layer"]["16"] == earlier["us_per_layer"]["16"]
    assert now["us_per_layer"]["8"] == {"warp_decode": 87.5, "expert_centric": 105.3}
    # Another device's measurements are not mixed in.
    other = crossover_entry(earlier, "H200", 128, 8, "fp8", [_row(1, 17.0, 30.0)])
    assert set(other["winners"]) == {"1"} and other["device"] == "H200"
