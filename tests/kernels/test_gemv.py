"""The skinny decode matmul against F.linear (Triton interpreter on the CPU)."""

import pytest
import torch
import torch.nn.functional as F

from kernels.gemv import skinny_linear


@pytest.mark.parametrize("rows,n_out,k_in", [(1, 40, 96), (3, 33, 100), (16, 16, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(rows, n_out, k_in, dtype, bias):
    g = torch.Generator().manual_seed(rows * n_out)
    x = torch.randn(rows, k_in, generator=g).to(dtype)
    w = (torch.randn(n_out, k_in, generator=g) / k_in**0.5).to(dtype)
    b = torch.randn(n_out, generator=g).to(dtype) if bias else None
    got = skinny_linear(x, w, b, block_n=16, block_k=32)
    expected = F.linear(x.double(), w.double(), b.double() if bias else None)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.isfinite(got.float()).all()
    assert ((got.double() - expected).abs().max() / expected.abs().max()).item() < tol
