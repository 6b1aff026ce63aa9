"""`linear(x, w, bias)`: F.linear over a plain or quantized weight (kernels.quant).

Quantized weights on CUDA with a decode's few rows go to the skinny GEMV, which reads them as
stored; otherwise (the CPU, or a prefill's many rows, where the product is compute-bound) the
weight is dequantized to x's dtype for the library GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.quant import Weight, dequantize, is_quantized, kernels_read

SKINNY_MAX_ROWS = 16  # kernels.gemv.MAX_ROWS, kept here so choosing needs no Triton import


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not is_quantized(w):
        return F.linear(x, w, bias)
    rows = x.numel() // x.shape[-1]
    if x.is_cuda and rows <= SKINNY_MAX_ROWS and kernels_read(w):
        from kernels.gemv import skinny_linear

        return skinny_linear(x.reshape(rows, -1), w, bias).reshape(*x.shape[:-1], -1)
    return F.linear(x, dequantize(w, x.dtype), bias)
