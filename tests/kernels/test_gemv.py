"""The skinny decode matmul against F.linear, and its fused residual add + RMSNorm prologue
against `add_rms_norm` followed by the matmul (Triton interpreter on the CPU)."""

import pytest
import torch
import torch.nn.functional as F
from quantized_layers import poison_torch_empty, quantize

from kernels.counters import counters_of
from kernels.fused_ops import add_rms_norm
from kernels.gemv import COUNTERS_USER, norm_linear, skinny_linear
from kernels.quant import dequantize


@pytest.mark.parametrize("rows,n_out,k_in", [(1, 40, 96), (3, 33, 100), (16, 16, 64), (27, 20, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split_k", [1, 3])
def test_matches_linear(rows, n_out, k_in, dtype, bias, split_k, monkeypatch):
    poison_torch_empty(monkeypatch)
    g = torch.Generator().manual_seed(rows * n_out)
    x = torch.randn(rows, k_in, generator=g).to(dtype)
    w = (torch.randn(n_out, k_in, generator=g) / k_in**0.5).to(dtype)
    b = torch.randn(n_out, generator=g).to(dtype) if bias else None
    got = skinny_linear(x, w, b, block_n=16, block_k=32, split_k=split_k)
    expected = F.linear(x.double(), w.double(), b.double() if bias else None)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.isfinite(got.float()).all()
    assert ((got.double() - expected).abs().max() / expected.abs().max()).item() < tol


def _norm_case(rows, k_in, dtype, with_delta, seed):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, k_in, generator=g)).to(dtype)
    delta = torch.randn(rows, k_in, generator=g).to(dtype) if with_delta else None
    norm_w = (1 + 0.3 * torch.randn(k_in, generator=g)).to(dtype)
    return x, delta, norm_w, g


@pytest.mark.parametrize("rows,n_out,k_in", [(1, 40, 96), (5, 33, 100), (19, 24, 72)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("split_k", [1, 2])
def test_norm_linear_is_add_rms_norm_then_linear(
    rows, n_out, k_in, dtype, with_delta, split_k, monkeypatch
):
    poison_torch_empty(monkeypatch)
    x, delta, norm_w, g = _norm_case(rows, k_in, dtype, with_delta, seed=rows + k_in)
    w = (torch.randn(n_out, k_in, generator=g) / k_in**0.5).to(dtype)
    total, y = norm_linear(x, delta, norm_w, 1e-6, w, block_n=16, block_k=32, split_k=split_k)
    ref_total, h = add_rms_norm(x, delta, norm_w, 1e-6)
    # The sum is one rounded add either way; the norm's statistics differ only in fp32 order.
    assert torch.equal(total, ref_total)
    expected = h.double() @ w.double().T
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert y.shape == (rows, n_out) and torch.isfinite(y.float()).all()
    assert ((y.double() - expected).abs().max() / expected.abs().max()).item() < tol


@pytest.mark.parametrize("fmt,size", [("fp8", 16), ("int4", 32)])
@pytest.mark.parametrize("split_k", [1, 3])
def test_norm_linear_reads_quantized_weights(fmt, size, split_k, monkeypatch):
    poison_torch_empty(monkeypatch)
    x, delta, norm_w, g = _norm_case(3, 96, torch.bfloat16, True, seed=size)
    w = quantize(torch.randn(37, 96, generator=g) / 96**0.5, fmt, size)
    bias = torch.randn(37, generator=g).bfloat16()
    total, y = norm_linear(x, delta, norm_w, 1e-6, w, bias, block_n=16, block_k=32, split_k=split_k)
    _, h = add_rms_norm(x, delta, norm_w, 1e-6)
    expected = h.double() @ dequantize(w, torch.float64).T + bias.double()
    assert ((y.double() - expected).norm() / expected.norm()).item() < 1e-2


@pytest.mark.parametrize("fmt,size", [("fp8", 32), ("int4", 32), ("int4", 16)])
@pytest.mark.parametrize("scale_weights", [False, True])
@pytest.mark.parametrize("split_k", [1, 2])
def test_scales_on_the_weights_or_on_the_partial_products(
    fmt, size, scale_weights, split_k, monkeypatch
):
    """Either placement of a quantized weight's scales against float64 on the dequantized
    weight (ragged rows and a last K step cut short), and the two placements against each
    other."""
    poison_torch_empty(monkeypatch)
    g = torch.Generator().manual_seed(size + split_k)
    x = torch.randn(3, 160, generator=g).bfloat16()
    w = quantize(torch.randn(37, 160, generator=g) / 160**0.5, fmt, size)
    tiles = dict(block_n=16, block_k=32, split_k=split_k)
    y = skinny_linear(x, w, scale_weights=scale_weights, **tiles)
    expected = x.double() @ dequantize(w, torch.float64).T
    assert ((y.double() - expected).norm() / expected.norm()).item() < 5e-3
    other = skinny_linear(x, w, scale_weights=not scale_weights, **tiles)
    assert ((y.double() - other.double()).norm() / expected.norm()).item() < 5e-3


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_split_k_gives_the_same_bits_every_launch_and_resets_its_counters(fmt, monkeypatch):
    """The last part to arrive adds the partials in a fixed order, so the result does not depend
    on which part came last; and each launch leaves the shared arrival counters at zero."""
    poison_torch_empty(monkeypatch)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 256, generator=g).bfloat16()
    dense = torch.randn(48, 256, generator=g) / 16
    w = dense.bfloat16() if fmt == "bf16" else quantize(dense, "int4", 32)
    first = skinny_linear(x, w, block_n=16, block_k=32, split_k=4)
    for _ in range(3):
        assert torch.equal(skinny_linear(x, w, block_n=16, block_k=32, split_k=4), first)
    assert not counters_of(x.device, COUNTERS_USER).any()
    whole = skinny_linear(x, w, block_n=16, block_k=32, split_k=1)
    assert ((first.double() - whole.double()).norm() / whole.double().norm()).item() < 1e-2


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """kernels/configs/ in a temporary folder, so a test's tables never reach the repo's."""
    from kernels import tuned

    monkeypatch.setattr(tuned, "CONFIG_DIR", tmp_path)
    tuned.load.cache_clear()
    yield tmp_path
    tuned.load.cache_clear()


def test_tuned_tiles_come_from_the_table_of_the_nearest_rows(config_dir):
    from engine.bench.projections import store_tuned
    from kernels.gemv import DEFAULT_TILES, tuned_tiles

    one = dict(block_n=32, block_k=64, num_warps=4, split_k=2)
    eight = dict(block_n=16, block_k=32, num_warps=8, split_k=3)
    cases = [
        dict(fmt="fp8", out=40, k=96, rows=1, best_tile=one),
        dict(fmt="fp8", out=40, k=96, rows=8, best_tile=eight),
    ]
    (path,) = store_tuned(cases, "a GPU")
    assert path.endswith("gemv_fp8_N40_K96.json")
    assert tuned_tiles("fp8", 40, 96, 1) == {**DEFAULT_TILES, **one}
    assert tuned_tiles("fp8", 40, 96, 6) == {**DEFAULT_TILES, **eight}
    assert tuned_tiles("int4", 40, 96, 1) == DEFAULT_TILES  # another format: no table
    assert tuned_tiles("fp8", 40, 128, 1) == DEFAULT_TILES  # another size


def test_bf16_tables_say_where_the_gemv_beats_the_library(config_dir):
    from engine.bench.projections import store_tuned
    from kernels.gemv import beats_library, tuned_tiles

    tile = dict(block_n=32, block_k=64, num_warps=4, split_k=2)
    cases = [
        dict(fmt="bf16", out=40, k=96, rows=1, best_tile=tile, best_us=8.0, cublas_us=9.0),
        dict(fmt="bf16", out=40, k=96, rows=8, best_tile=tile, best_us=9.5, cublas_us=9.0),
    ]
    store_tuned(cases, "a GPU")
    assert beats_library(40, 96, 1) and beats_library(40, 96, 3)
    assert not beats_library(40, 96, 8)
    assert not beats_library(40, 128, 1)  # untuned: the library
    assert "beats_library" not in tuned_tiles("bf16", 40, 96, 1)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4"])
def test_a_call_without_tiles_runs_the_tuned_ones(fmt, config_dir):
    """The table's tiles (a split of K the CPU default never takes) give the same bits as the
    same tiles passed by hand, and differ from the defaults' only by the order of the sums."""
    from engine.bench.projections import store_tuned

    g = torch.Generator().manual_seed(11)
    rows, n_out, k_in = 3, 40, 256
    x = torch.randn(rows, k_in, generator=g).bfloat16()
    w = (torch.randn(n_out, k_in, generator=g) / k_in**0.5).bfloat16()
    w = w if fmt == "bf16" else quantize(w, fmt, 32)
    untuned = skinny_linear(x, w)
    tiles = dict(block_n=32, block_k=64, num_warps=4, split_k=4)
    store_tuned([dict(fmt=fmt, out=n_out, k=k_in, rows=1, best_tile=tiles)], "a GPU")
    got = skinny_linear(x, w)
    assert torch.equal(got, skinny_linear(x, w, **tiles))
    assert torch.allclose(got.float(), untuned.float(), rtol=2e-2, atol=2e-2)
    # Explicit tiles still win over the table.
    assert torch.equal(skinny_linear(x, w, block_n=16, block_k=256, split_k=1), untuned)
