"""Skinny matmul for decode-sized inputs: y [M, N] = x [M, K] @ w[N, K]^T with M <= 16.

At decode, a projection (q/k/v, o, router, lm_head) is one pass over its weight matrix: its
speed is the weight read. Each program streams a BLOCK_N x K stripe of w once, holds the few
activation rows in registers, and accumulates in fp32 on the tensor cores (rows padded to 16,
which costs nothing in a read-bound kernel). Used by the CUDA decode step where it is measured
faster than the library GEMM (`engine.bench.decode`).

w may be quantized (kernels.quant): FP8 blocks or int4 groups, read as stored and dequantized
in registers (`quantized_dot`, shared with kernels.fused_moe); activations stay as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant import (
    Weight,
    is_quantized,
    kernel_weight,
)
from kernels.quant_tiles import k_step, quantized_dot
from kernels.triton_env import interpreting

MAX_ROWS = 16


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    n_rows,
    n_out,
    k_in,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
    INTERPRET: tl.constexpr,
    FORMAT: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    PER_ITEM: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < n_out
    mask_m = offs_m < n_rows
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    if FORMAT == 0:
        for k0 in range(0, k_in, BLOCK_K):
            mask_k = k0 + offs_k < k_in
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :],
                mask=mask_n[:, None] & mask_k[None, :],
                other=0.0,
            )
            if INTERPRET:  # the interpreter can't multiply bf16
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc)
    else:
        offs_c = tl.arange(0, BLOCK_K // PER_ITEM)  # stored items (int4: words) of a step
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_c[None, :]
        rows = tl.minimum(offs_n, n_out - 1)  # masked rows read a real scale
        s_rows = s_ptr + (rows // SCALE_ROWS).to(tl.int64) * stride_sn
        for k0 in range(0, k_in, BLOCK_K):
            mask_k = k0 + offs_k < k_in
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )
            if INTERPRET:  # the dot's operands: fp32 there, else x's dtype
                x = x.to(tl.float32)
            mask_w = mask_n[:, None] & (k0 + offs_c * PER_ITEM < k_in)[None, :]
            w = tl.load(w_ptrs, mask=mask_w, other=0)
            acc = quantized_dot(x, w, s_rows, k0, k_in, acc, FORMAT, SCALE_COLS, BLOCK_K)
            w_ptrs += BLOCK_K // PER_ITEM
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def skinny_linear(
    x: torch.Tensor,
    w: Weight,
    bias: torch.Tensor | None = None,
    block_n: int = 16,
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """F.linear(x, w, bias) for x [M, K] with M <= 16 rows, in x's dtype (fp32 accumulation).

    w [N, K] is a tensor or a quantized weight (kernels.quant.kernels_read); a quantized weight's
    K steps shrink to fit its scales (`k_step`)."""
    n_rows, k_in = x.shape
    n_out = w.shape[0]
    assert n_rows <= MAX_ROWS and len(w.shape) == 2 and w.shape[1] == k_in
    assert is_quantized(w) or w.stride(1) == 1, "a plain w must be contiguous along K"
    kw = kernel_weight(w)
    block_k = k_step(block_k, kw)
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(n_rows, n_out, dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n_out, block_n),)](
        x,
        kw.stored,
        kw.scale,
        bias if bias is not None else kw.stored,
        y,
        n_rows,
        n_out,
        k_in,
        x.stride(0),
        kw.stored.stride(0),
        kw.scale.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ROWS=MAX_ROWS,
        INTERPRET=interpreting(),
        FORMAT=kw.format,
        SCALE_ROWS=kw.scale_rows,
        SCALE_COLS=kw.scale_cols,
        PER_ITEM=kw.per_item,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y
