"""Skinny matmul for decode-sized inputs: y [M, N] = x [M, K] @ w[N, K]^T with M <= 16.

At decode, a projection (q/k/v, o, router, lm_head) is one pass over its weight matrix: its
speed is the weight read. Each program streams a BLOCK_N x K stripe of w once, holds the few
activation rows in registers, and accumulates in fp32 on the tensor cores (rows padded to 16,
which costs nothing in a read-bound kernel). Used by the CUDA decode step where it is measured
faster than the library GEMM (`engine.bench.decode`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_env import interpreting

MAX_ROWS = 16


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    n_rows,
    n_out,
    k_in,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < n_out
    mask_m = offs_m < n_rows
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
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
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_n: int = 16,
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """F.linear(x, w, bias) for x [M, K] with M <= 16 rows, in x's dtype (fp32 accumulation)."""
    n_rows, k_in = x.shape
    n_out = w.shape[0]
    assert n_rows <= MAX_ROWS and w.shape[1] == k_in and w.stride(1) == 1
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(n_rows, n_out, dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n_out, block_n),)](
        x,
        w,
        bias if bias is not None else w,
        y,
        n_rows,
        n_out,
        k_in,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ROWS=MAX_ROWS,
        INTERPRET=interpreting(),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y
