"""Warp decode over quantized weights (FP8 blocks, int4 groups), through Triton's CPU
interpreter, against a float64 reference on the dequantized weights (kernels.quant.dequantize).

The weights come from the project's own quantizers (engine.loading.fp8 / int4); shapes are not
multiples of the kernels' tiles, and FP8 blocks are ragged at the matrices' ends. The kernels
read the stored bytes; the only roundings are bf16's (the intermediate and the output).
"""

import pytest
import torch
from quantized_layers import quantized_moe_layer

from engine.loading import fp8, int4
from kernels import reference
from kernels.quant import Fp8Weight, Int4Weight, dequantize, kernels_read, nbytes
from kernels.warp_decode import warp_decode_moe

# Small tiles so the loops run several steps; the kernels shrink them to fit the scales.
SMALL = {
    "gate_up": {"BLOCK_I": 16, "BLOCK_H": 32, "num_warps": 4},
    "down": {"BLOCK_H": 16, "BLOCK_I": 32, "num_warps": 4},
}
PRELOAD = {"gate_up": SMALL["gate_up"], "down": {**SMALL["down"], "preload": True}}


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
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("config", [SMALL, PRELOAD], ids=["plain", "preload"])
def test_warp_decode_reads_quantized_weights(case, config):
    tokens, hidden, inter, experts, top_k, fmt, size = case
    layer = quantized_moe_layer(*case, seed=sum(case[:5]) + size)
    y = warp_decode_moe(*layer, config=config)
    assert y.shape == (tokens, hidden) and y.dtype == torch.bfloat16
    assert torch.isfinite(y).all()
    ref = float64_reference(*layer)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    # bf16 output rounding (the interpreter truncates instead of rounding: up to 2x that)
    assert err < 8e-3, err


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
