"""`linear(x, w, bias)`: F.linear over a plain or quantized weight (kernels.quant), what the
model's attention projections, dense MLPs and lm_head call.

Quantized weights on CUDA with a decode's few rows go to the skinny GEMV (kernels.gemv), which
reads them as stored; otherwise (the CPU, or a prefill's many rows, where the product is
compute-bound and the library GEMM wins) the weight is dequantized to x's dtype for that call,
on CUDA in one pass (kernels.dequantize).
Plain bf16 weights take the library's GEMM, or the skinny GEMV at the sizes and row counts where
its tuned table measured it faster (kernels.gemv.beats_library).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.quant import Weight, dequantize, is_quantized, kernels_read


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for x [..., K] and w [N, K], in x's dtype."""
    quantized = is_quantized(w)
    if x.is_cuda and (kernels_read(w) if quantized else w.dtype == torch.bfloat16):
        from kernels.gemv import MAX_ROWS, beats_library, skinny_linear  # imports Triton

        rows = x.numel() // max(1, x.shape[-1])
        if 0 < rows <= MAX_ROWS and (quantized or beats_library(*w.shape, rows)):
            return skinny_linear(x.reshape(rows, -1), w, bias).reshape(*x.shape[:-1], -1)
    if quantized and x.is_cuda:
        from kernels.dequantize import applies, dequantize_weight  # imports Triton

        if applies(w):
            return F.linear(x, dequantize_weight(w, x.dtype), bias)
    return F.linear(x, dequantize(w, x.dtype) if quantized else w, bias)
