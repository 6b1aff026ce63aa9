"""The GEMM kernels over quantized weights (FP8 blocks, int4 groups): the expert-centric fused
MoE, the skinny decode matmul and `quant_linear.linear`, through Triton's CPU interpreter,
against float64 on the dequantized weights (kernels.quant.dequantize).

The weights come from the project's own quantizers (engine.loading.fp8 / int4); shapes are not
multiples of the tiles and FP8 blocks are ragged at the matrices' ends (and, in the fused
gate/up weight, may hold gate and up rows alike). The only roundings are the activation dtype's.
"""

import pytest
import torch
import torch.nn.functional as F
from quantized_layers import poison_torch_empty, quantize, quantized_moe_layer

from kernels import fused_moe as ec
from kernels import reference, tuned
from kernels.gemv import skinny_linear
from kernels.quant import dequantize
from kernels.quant_linear import linear

# Small tiles so the K loops run several steps; the stages shrink BLOCK_K to fit the scales.
FUSED_SMALL = {
    "BLOCK_M": 16,
    "gate_up": {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2},
    "down": {"BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2},
}


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    """Every torch.empty starts as NaN (ints: a large sentinel): unwritten outputs can't pass."""
    poison_torch_empty(monkeypatch)


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


# (tokens, hidden, inter, experts, top_k, format, block or group).
# FP8 16: H = 70 and I = 40 end in ragged blocks, gate/up rows 32..47 share a block;
# FP8 32: H = 72 ragged, gate and up share rows 32..63; FP8 64: I = 40 < one block;
# FP8 24: blocks narrower than a dot's K step (a scale per weight); int4 groups of 16 and 32.
FUSED_CASES = [
    (5, 70, 40, 6, 3, "fp8", 16),
    (3, 72, 48, 8, 2, "fp8", 32),
    (8, 72, 40, 8, 2, "fp8", 64),
    (3, 64, 40, 4, 2, "fp8", 24),
    (5, 80, 48, 6, 3, "int4", 16),
    (4, 96, 32, 4, 1, "int4", 32),
]


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: "-".join(map(str, c)))
def test_fused_moe_reads_quantized_weights(case):
    tokens, hidden = case[:2]
    layer = quantized_moe_layer(*case, seed=sum(case[:5]) + case[6])
    y = ec.fused_moe(*layer, config=FUSED_SMALL)
    assert y.shape == (tokens, hidden) and y.dtype == torch.bfloat16
    assert torch.isfinite(y).all(), "unwritten (NaN) or broken outputs"
    x, w_gate_up, w_down, ids, weights = layer
    ref = reference.moe_float64(
        x, dequantize(w_gate_up, torch.float64), dequantize(w_down, torch.float64), ids, weights
    )
    # bf16 roundings: the intermediate, each expert's output before the combine, the sum (the
    # interpreter truncates, up to twice rounding's error).
    assert rel_err(y, ref) < 1.5e-2
    atol = 3e-2 * ref.abs().max().item()
    torch.testing.assert_close(y.double(), ref, atol=atol, rtol=5e-2)


@pytest.mark.parametrize("case", [c for c in FUSED_CASES if c[5] != "bf16"], ids=str)
def test_either_scale_placement_gives_the_same_layer(case):
    """SCALE_WEIGHTS flipped from the format's way (FP8: each weight times its block's scale
    before the dot, the prefill tiles' option; int4: each group's scale on the partial
    products) against float64, and against the format's way."""
    layer = quantized_moe_layer(*case, seed=sum(case[:5]) + case[6])
    flipped = case[5] == "fp8"
    scaled = {g: dict(FUSED_SMALL[g], SCALE_WEIGHTS=flipped) for g in ("gate_up", "down")}
    y = ec.fused_moe(*layer, config=dict(FUSED_SMALL, **scaled))
    x, w_gate_up, w_down, ids, weights = layer
    ref = reference.moe_float64(
        x, dequantize(w_gate_up, torch.float64), dequantize(w_down, torch.float64), ids, weights
    )
    assert rel_err(y, ref) < 1.5e-2
    assert rel_err(y, ec.fused_moe(*layer, config=FUSED_SMALL).double()) < 1.5e-2


def test_fused_moe_default_tiles_fit_the_scales():
    """The default (large) BLOCK_K shrinks to an int4 group of 16; the K loops stay correct."""
    layer = quantized_moe_layer(6, 96, 48, 4, 2, "int4", 16, seed=7)
    x, w_gate_up, w_down, ids, weights = layer
    y = ec.fused_moe(*layer)
    ref = reference.moe_float64(x, dequantize(w_gate_up), dequantize(w_down), ids, weights)
    assert torch.isfinite(y).all() and rel_err(y, ref.double()) < 1.5e-2


def test_fused_moe_tables_by_format(monkeypatch):
    """A format's own tuned table first (fused_moe_fp8_*), else bf16's."""
    fp8_cfg = {"BLOCK_M": 32, "gate_up": {}, "down": {}}
    bf16_cfg = {"BLOCK_M": 16, "gate_up": {}, "down": {}}
    tables = {
        tuned.shape_name("fused_moe_fp8", 64, 32, 8, 2): {"configs": {"4": fp8_cfg}},
        tuned.shape_name("fused_moe", 64, 32, 8, 2): {"configs": {"4": bf16_cfg}},
    }
    monkeypatch.setattr(tuned, "load", tables.get)
    assert ec.default_config(4, 64, 32, 8, 2, "fp8") is fp8_cfg
    assert ec.default_config(4, 64, 32, 8, 2, "int4") is bf16_cfg
    assert ec.default_config(4, 64, 32, 8, 2) is bf16_cfg


def test_prompt_chunks_take_their_own_entries_and_decode_batches_theirs(monkeypatch):
    """A format's table of prompt-chunk entries (engine.bench.prefill_moe) speaks for chunks of
    that size and longer, never for a decode batch; a table of decode batches, for batches
    within a factor of two of an entry; past both, the defaults."""
    chunk = {"BLOCK_M": 128, "gate_up": {}, "down": {}}
    batch = {"BLOCK_M": 16, "gate_up": {}, "down": {}}
    tables = {
        tuned.shape_name("fused_moe_fp8", 64, 32, 8, 2): {"configs": {"512": chunk}},
        tuned.shape_name("fused_moe", 64, 32, 8, 2): {"configs": {"1": batch, "64": batch}},
    }
    monkeypatch.setattr(tuned, "load", tables.get)
    for tokens in (300, 512, 2048, 20000):
        assert ec.default_config(tokens, 64, 32, 8, 2, "fp8") is chunk
    for tokens in (1, 16, 100, 128):
        assert ec.default_config(tokens, 64, 32, 8, 2, "fp8") is batch
    assert ec.default_config(200, 64, 32, 8, 2, "fp8") is ec.PREFILL_CONFIG  # 200: 64 too far
    assert ec.default_config(2048, 64, 32, 8, 2) is ec.PREFILL_CONFIG  # bf16 has no chunk entry


# (format, block or group, N, K): odd N everywhere; FP8 K ragged at the last block (and blocks
# of 8, narrower than a dot's K step); int4 K a multiple of the group.
SKINNY_CASES = [
    ("fp8", 16, 37, 72),
    ("fp8", 64, 45, 100),
    ("fp8", 8, 21, 60),
    ("int4", 16, 37, 80),
    ("int4", 32, 33, 96),
]


@pytest.mark.parametrize("case", SKINNY_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_linear_reads_quantized_weights(case, rows, dtype):
    fmt, size, n_out, k_in = case
    gen = torch.Generator().manual_seed(rows * n_out + size)
    w = quantize(torch.randn(n_out, k_in, generator=gen) / k_in**0.5, fmt, size)
    x = torch.randn(rows, k_in, generator=gen).to(dtype)
    bias = torch.randn(n_out, generator=gen).to(dtype) if rows == 3 else None
    got = skinny_linear(x, w, bias, block_n=16, block_k=32)
    assert got.shape == (rows, n_out) and got.dtype == dtype
    assert torch.isfinite(got.float()).all()
    expected = x.double() @ dequantize(w, torch.float64).T
    if bias is not None:
        expected += bias.double()
    # fp32: exact products, fp32 sums; bf16: the output's rounding (truncation here).
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(got, expected) < tol


@pytest.mark.parametrize("fmt,size", [("fp8", 32), ("int4", 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_on_the_cpu_is_f_linear_on_the_dequantized_weight(fmt, size, dtype):
    gen = torch.Generator().manual_seed(size)
    w = quantize(torch.randn(40, 96, generator=gen) / 96**0.5, fmt, size)
    x = torch.randn(2, 5, 96, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype)
    got = linear(x, w, bias)
    assert got.shape == (2, 5, 40) and got.dtype == dtype
    assert torch.equal(got, F.linear(x, dequantize(w, dtype), bias))
    plain = dequantize(w, dtype)
    assert torch.equal(linear(x, plain), F.linear(x, plain))
