"""engine.bench.moe_formats' tuning candidates (no GPU: only the configs it would time)."""

import torch

from engine.bench.moe_formats import (
    PAIRED_TILES,
    SHAPE,
    down_tiles,
    gate_up_tiles,
    paired,
    warp_candidates,
)
from kernels import warp_decode
from kernels.quant import INT4_GROUPS, KernelWeight

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


def test_first_round_varies_one_kernel_at_a_time():
    candidates = warp_candidates("int4", STORED)
    assert candidates[0] == STORED
    assert len(candidates) == len({str(c) for c in candidates})  # no config timed twice
    for cfg in candidates[1:]:
        assert cfg["gate_up"] == STORED["gate_up"] or cfg["down"] == STORED["down"]
    assert {str(c["gate_up"]) for c in candidates} == {
        str(t) for t in gate_up_tiles("int4") + [STORED["gate_up"]]
    }
    assert {str(c["down"]) for c in candidates} == {
        str(t) for t in down_tiles("int4") + [STORED["down"]]
    }


def test_second_round_pairs_the_fastest_tiles_not_yet_timed():
    first = warp_candidates("int4", STORED)
    # Times that rank the first round in reverse order of the list.
    timed = sorted(((float(len(first) - n), c) for n, c in enumerate(first)), key=lambda t: t[0])
    fastest = {
        kernel: list({str(c[kernel]): c[kernel] for _, c in timed}.values())[:PAIRED_TILES]
        for kernel in ("gate_up", "down")
    }
    pairs = paired(timed, first)
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
    none = torch.empty(0)
    w = KernelWeight(none, none, INT4_GROUPS, scale_rows=1, scale_cols=128, per_item=8)
    for tile in down_tiles("int4"):
        _, block_h, block_i = warp_decode._down_tiles(tile, w, h, i, k)
        assert (block_h, block_i) == (tile["BLOCK_H"], tile["BLOCK_I"]), tile
