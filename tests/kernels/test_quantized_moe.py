"""Warp decode over quantized weights (FP8 blocks, int4 groups), through Triton's CPU
interpreter, against a float64 reference on the dequantized weights (kernels.quant.dequantize).

The weights come from the project's own quantizers (engine.loading.fp8 / int4); shapes are not
multiples of the kernels' tiles, and FP8 blocks are ragged at the matrices' ends. The kernels
read the stored bytes; the only roundings are bf16's (the intermediate and the output).
"""

import pytest
import torch
import triton
import triton.language as tl
from quantized_layers import quantized_moe_layer

from engine.loading import fp8, int4
from kernels import reference
from kernels.quant import (
    FP8_BLOCKS,
    INT4_GROUPS,
    Fp8Weight,
    Int4Weight,
    KernelWeight,
    dequantize,
    kernels_read,
    nbytes,
    unpack_int4,
)
from kernels.quant_tiles import int4_plane, int4_plane_scale, int4_upper_half, int4_values
from kernels.warp_decode import warp_decode_moe

# Small tiles so the loops run several steps; the kernels shrink them to fit the scales.
SMALL = {
    "gate_up": {"BLOCK_I": 16, "BLOCK_H": 32, "num_warps": 4},
    "down": {"BLOCK_H": 16, "BLOCK_I": 32, "num_warps": 4},
}
PRELOAD = {"gate_up": SMALL["gate_up"], "down": {**SMALL["down"], "preload": True}}
# 64 columns before the wait, over several FP8 blocks (a scale per column) or int4 groups (a
# scale per word): the whole row where it is no longer, else the loop goes on after them.
PRELOAD_WIDE = {"gate_up": SMALL["gate_up"], "down": {**SMALL["down"], "preload": 64}}
# Both loops pipelined three steps deep (on the GPU: async copies of the later steps' weights).
PIPELINED = {
    "gate_up": {**SMALL["gate_up"], "loop_stages": 3},
    "down": {**SMALL["down"], "preload": True, "loop_stages": 3},
}
# Both kernels' items from one launch (kernels.warp_decode.persistent_moe).
PERSISTENT = {**PIPELINED, "persistent": 4}


def float64_reference(x, w_gate_up, w_down, ids, weights):
    return reference.moe_float64(
        x, dequantize(w_gate_up, torch.float64), dequantize(w_down, torch.float64), ids, weights
    )


# (tokens, hidden, inter, experts, top_k, format, block or group). FP8: blocks ragged at the
# end of H (72 = 64 + 8) and of I's down columns; int4: groups of 32 and 16, tiles ragged at
# the end of H (80 = 64 + 16) and I (48 = 32 + 16).
CASES = [
    (1, 72, 64, 8, 2, "fp8", 64),
    (3, 72, 64, 8, 2, "fp8", 32),
    (5, 96, 48, 6, 3, "fp8", 16),
    (5, 70, 40, 6, 3, "fp8", 16),  # I = 40: a block holds gate and up rows
    (2, 72, 48, 6, 2, "fp8", 24),  # blocks of 24: a scale per column
    (1, 64, 64, 8, 2, "int4", 32),
    (4, 80, 48, 6, 3, "int4", 16),
    (2, 64, 48, 4, 1, "int4", 16),
    (3, 72, 160, 8, 3, "fp8", 32),  # longer rows: the loop runs after a wide preload
    (3, 96, 160, 8, 3, "int4", 32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize(
    "config",
    [SMALL, PRELOAD, PRELOAD_WIDE, PIPELINED, PERSISTENT],
    ids=["plain", "preload", "preload-wide", "pipelined", "persistent"],
)
def test_warp_decode_reads_quantized_weights(case, config):
    tokens, hidden, inter, experts, top_k, fmt, size = case
    layer = quantized_moe_layer(*case, seed=sum(case[:5]) + size)
    y = warp_decode_moe(*layer, config=config)
    assert y.shape == (tokens, hidden) and y.dtype == torch.bfloat16
    assert torch.isfinite(y).all()
    ref = float64_reference(*layer)
    # bf16 output rounding (the interpreter truncates instead of rounding: up to 2x that)
    assert relative_error(y, ref) < 8e-3


def relative_error(y, ref) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


# Raggedness in the rows: row blocks past the size (a ragged last block, after full ones), and
# padded top-k slots (3 -> 4). Column steps: several per group (groups of 128, steps of 64), or
# whole groups (groups of 32: ROWS_64's steps of 128 columns, and WIDE_STEPS). A step or a
# preload wider than a group (the whole row, masked past its end) takes a scale per word.
ROWS_64 = {
    "gate_up": {"BLOCK_I": 64, "BLOCK_H": 64, "num_warps": 4},
    "down": {"BLOCK_H": 64, "BLOCK_I": 128, "num_warps": 4},
}
ROWS_256 = {
    "gate_up": {"BLOCK_I": 256, "BLOCK_H": 64, "num_warps": 4},
    "down": {"BLOCK_H": 256, "BLOCK_I": 128, "num_warps": 4},
}
# Steps of four groups of 32 (a scale per word), ragged at the ends of H and I or not.
WIDE_STEPS = {
    "gate_up": {"BLOCK_I": 16, "BLOCK_H": 128, "num_warps": 4},
    "down": {"BLOCK_H": 16, "BLOCK_I": 128, "num_warps": 4},
}
# (tokens, hidden, inter, experts, top_k, group, config): H and I are multiples of the group,
# ragged against the tiles.
INT4_CASES = [
    (1, 96, 160, 8, 1, 32, ROWS_64),  # rows 64 + 32 (down), 2 x 64 + 32 (gate/up)
    (3, 96, 160, 8, 3, 32, ROWS_64),
    (1, 384, 640, 8, 3, 128, ROWS_256),  # rows 256 + 128 (down), 2 x 256 + 128 (gate/up)
    (2, 384, 640, 6, 1, 128, ROWS_256),
    (2, 160, 96, 8, 3, 32, WIDE_STEPS),  # H: a step of 4 groups, then 1; I: 3 groups of 4
    (3, 256, 256, 8, 2, 32, WIDE_STEPS),
]


@pytest.mark.parametrize(
    "case", INT4_CASES, ids=lambda c: "-".join(map(str, c[:6])) + f"-rows{c[6]['down']['BLOCK_H']}"
)
@pytest.mark.parametrize(
    "preload",
    [False, True, 64, 1024],
    ids=["plain", "preload", "preload-two-groups", "preload-whole-row"],
)
def test_int4_warp_decode_by_planes(case, preload):
    """The int4 pair reads each word as eight planes of values (kernels.quant_tiles.int4_plane)
    against strided activations, a word's scale applied once to its eight products: the float64
    answer on the dequantized weights, up to bf16 rounding."""
    tokens, hidden, inter, experts, top_k, group, config = case
    config = {"gate_up": config["gate_up"], "down": {**config["down"], "preload": preload}}
    layer = quantized_moe_layer(tokens, hidden, inter, experts, top_k, "int4", group, seed=group)
    x = layer[0]
    assert (x != 0).all()
    y = warp_decode_moe(*layer, config=config)
    assert y.shape == (tokens, hidden) and torch.isfinite(y).all()
    ref = float64_reference(*layer)
    # bf16 output rounding (the interpreter truncates instead of rounding: up to 2x that)
    assert relative_error(y, ref) < 8e-3
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 2e-2


def test_int4_steps_span_whole_groups_of_a_power_of_two():
    """Warp decode's int4 steps: within one group, or whole groups where the group is a power of
    two (a scale per word), and two words at least; FP8 and plain steps take any width."""
    none = torch.empty(0)

    def int4_weight(group):
        return KernelWeight(none, none, INT4_GROUPS, scale_rows=1, scale_cols=group, per_item=8)

    assert int4_weight(32).warp_tile_cols(128) == 128  # four groups
    assert int4_weight(128).warp_tile_cols(64) == 64  # within one
    assert int4_weight(48).warp_tile_cols(128) == 16  # within one: the largest power dividing 48
    assert int4_weight(16).warp_tile_cols(8) == 16  # two words
    fp8_weight = KernelWeight(none, none, FP8_BLOCKS, scale_rows=128, scale_cols=128, per_item=1)
    assert fp8_weight.warp_tile_cols(512) == 512


@pytest.mark.parametrize("preload", [True, 32, 64, 1024], ids=lambda p: f"preload-{p}")
def test_int4_groups_of_48(preload):
    """A group that is not a power of two: steps within it (16 columns), and a preload that does
    not divide it is cut to one step; one wider than a group gathers a scale per word."""
    config = {"gate_up": SMALL["gate_up"], "down": {**SMALL["down"], "preload": preload}}
    layer = quantized_moe_layer(2, 96, 144, 6, 2, "int4", 48, seed=48)
    y = warp_decode_moe(*layer, config=config)
    assert relative_error(y, float64_reference(*layer)) < 8e-3


def test_int4_one_launch_with_steps_of_whole_groups():
    """The persistent launch runs the same items with steps of four groups."""
    config = {
        "gate_up": {**WIDE_STEPS["gate_up"], "loop_stages": 2},
        "down": {**WIDE_STEPS["down"], "preload": True, "loop_stages": 2},
        "persistent": 4,
    }
    layer = quantized_moe_layer(2, 160, 96, 8, 3, "int4", 32, seed=5)
    y = warp_decode_moe(*layer, config=config)
    pair = warp_decode_moe(*layer, config={k: v for k, v in config.items() if k != "persistent"})
    assert torch.equal(y, pair)
    assert relative_error(y, float64_reference(*layer)) < 8e-3


@triton.jit
def _int4_unpack_kernel(words_ptr, planes_ptr, values_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    words = tl.load(words_ptr + offs)
    upper = int4_upper_half(words)
    for j in tl.static_range(8):
        tl.store(planes_ptr + offs * 8 + j, int4_plane(words, upper, j) * int4_plane_scale(j))
    tl.store(values_ptr + tl.arange(0, 8 * N), int4_values(words, 8 * N))


def test_int4_nibbles_become_floats_without_a_conversion():
    """OR-ing a nibble into 2**23's bits and subtracting 2**23 + 8 gives q exactly, for all 16
    values at every position (masked in place, then scaled back by a power of two), and for
    words with the sign bit set (int32's >> copies it into the upper half's upper bits, which no
    plane reads)."""
    nibbles = (torch.arange(16)[:, None] + torch.arange(8)[None, :]) % 16  # [word, position]
    words = (nibbles << (4 * torch.arange(8))).sum(dim=1)
    words = torch.cat([words, torch.tensor([0, 2**32 - 1, 2**31, 2**31 - 1, 0x89ABCDEF])])
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    words = torch.cat([words, words[:11]])  # 32 words: a power of two for tl.arange
    assert (words < 0).sum() >= 8
    planes = torch.empty(words.numel() * 8)
    values = torch.empty(words.numel() * 8)
    _int4_unpack_kernel[(1,)](words, planes, values, N=words.numel())
    expected = unpack_int4(words).float()
    assert set(expected[:128].tolist()) == set(range(-8, 8))
    assert torch.equal(planes, expected)
    assert torch.equal(values, expected)


def test_groups_narrower_than_a_tile_are_refused():
    """A tile holds one int4 scale and at least two words: groups of 8 are left to the
    dequantized path (kernels.quant.kernels_read)."""
    assert not kernels_read(int4.quantized_weight(torch.randn(2, 8, 64), 8))
    assert kernels_read(int4.quantized_weight(torch.randn(2, 8, 64), 32))
    assert kernels_read(fp8.quantized_weight(torch.randn(2, 8, 64), 16))
    with pytest.raises(ValueError, match="group"):
        layer = quantized_moe_layer(1, 64, 32, 4, 2, "int4", 8, seed=1)
        warp_decode_moe(*layer, config=SMALL)


def test_quantized_weights_keep_their_bytes():
    w = torch.randn(4, 64, 128)
    as_fp8, as_int4 = fp8.quantized_weight(w, 64), int4.quantized_weight(w, 32)
    assert isinstance(as_fp8, Fp8Weight) and isinstance(as_int4, Int4Weight)
    assert as_fp8.shape == as_int4.shape == w.shape
    assert nbytes(as_fp8) == w.numel() + 4 * (1 * 2) * 4  # a byte each, fp32 scales per block
    assert nbytes(as_int4) == w.numel() // 2 + w.numel() // 32 * 2  # half a byte, bf16 scales
    # The stored values dequantize to the bf16-rounded weight within the format's step.
    for q, step in ((as_fp8, 2**-3), (as_int4, 1 / 7)):
        back = dequantize(q)
        scale = w.abs().amax()
        assert ((back - w).abs().max() / scale).item() < step


def test_warp_decode_on_quantized_equals_it_on_the_dequantized_weights():
    """The same weights in bf16 (exact: our scales make every value a bf16) give the same
    output up to fp32 summation order."""
    layer = quantized_moe_layer(2, 64, 48, 8, 2, "int4", 16, seed=3)
    x, w_gate_up, w_down, ids, weights = layer
    y_q = warp_decode_moe(*layer, config=SMALL)
    y_bf16 = warp_decode_moe(
        x,
        dequantize(w_gate_up, torch.bfloat16),
        dequantize(w_down, torch.bfloat16),
        ids,
        weights,
        config=SMALL,
    )
    torch.testing.assert_close(y_q.float(), y_bf16.float(), atol=2e-2, rtol=2e-2)
