"""The one-pass GPU dequantize against kernels.quant.dequantize (Triton interpreter on the CPU):
the same values bit for bit, ragged FP8 blocks and odd sizes included."""

import pytest
import torch
from quantized_layers import poison_torch_empty, quantize

from kernels.dequantize import applies, dequantize_weight
from kernels.quant import dequantize, to


@pytest.mark.parametrize(
    "fmt,size,n_out,k_in",
    [("fp8", 128, 300, 520), ("fp8", 16, 45, 72), ("int4", 32, 77, 288), ("int4", 128, 33, 256)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equals_the_torch_dequantize(fmt, size, n_out, k_in, dtype, monkeypatch):
    poison_torch_empty(monkeypatch)
    g = torch.Generator().manual_seed(n_out * k_in)
    w = quantize(torch.randn(n_out, k_in, generator=g) / k_in**0.5, fmt, size)
    got = dequantize_weight(w, dtype)
    expected = dequantize(w, dtype)
    assert got.dtype == dtype and got.shape == (n_out, k_in)
    assert expected.abs().min() < expected.abs().max()  # random values, not a constant
    assert torch.equal(got, expected)


def test_takes_only_what_its_kernel_reads():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g)
    assert applies(quantize(w, "fp8", 16)) and applies(quantize(w, "int4", 32))
    assert not applies(w)  # a plain weight
    assert not applies(quantize(torch.randn(2, 64, 64, generator=g), "fp8", 16))  # experts
    with pytest.raises(ValueError):
        dequantize_weight(quantize(torch.randn(2, 64, 64, generator=g), "int4", 32), torch.float32)


def test_the_prefill_projections_bench_checks_on_the_cpu(capsys):
    """engine.bench.prefill_projections' checks (its timing needs a GPU) pass on a tiny shape."""
    from engine.bench.prefill_projections import main

    assert main(["--shape", "tiny", "--device", "cpu", "--copies", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("one pass equals torch's") == 4, out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel needs a GPU")
@pytest.mark.parametrize("fmt,size", [("fp8", 128), ("int4", 128), ("int4", 32)])
def test_gpu_compiled_equals_the_torch_dequantize(fmt, size):
    """The kernel compiled by Triton (not interpreted), at the 30B-A3B q/k/v size."""
    g = torch.Generator().manual_seed(size)
    w = quantize(torch.randn(5120, 2048, generator=g) / 2048**0.5, fmt, size)
    w = to(w, "cuda")
    assert torch.equal(dequantize_weight(w, torch.bfloat16), dequantize(w, torch.bfloat16))
