"""A quantized weight [N, K] (kernels.quant) to a plain one in one pass on the GPU: each stored
item read once, each value written once, for the products that take a library GEMM over the
dequantized weight (a prefill's projections, `kernels.quant_linear.linear`).

`kernels.quant.dequantize` builds the same values from torch ops: a full-size fp32 copy, a
full-size scale grid, their product and the cast, some 27 bytes of traffic a weight against 3
(FP8) or 2.5 (int4) here. Each value is the fp32 product of the stored value and its scale,
rounded once to the output dtype, so the two agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant import (
    FP8_BLOCKS,
    INT4_GROUPS,
    QuantWeight,
    is_quantized,
    kernel_weight,
    kernels_read,
    scale_tile,
)
from kernels.quant_tiles import fp8_values, int4_values

TILE_ELEMS = 8192  # values a program writes
MAX_BLOCK_K = 256


def tile(scale_cols: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): columns within one scale (an int4 group, an FP8 block's columns), so a
    row's tile takes one scale, broadcast along it; rows to fill the program."""
    block_k = scale_tile(MAX_BLOCK_K, scale_cols)
    return TILE_ELEMS // block_k, block_k


@triton.jit
def _dequantize_kernel(
    w_ptr,
    s_ptr,
    out_ptr,
    n_rows,
    n_cols,
    stride_wn,
    stride_sn,
    stride_on,
    FORMAT: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    PER_ITEM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    row_ptrs = rows.to(tl.int64)[:, None]
    if FORMAT == 2:  # int4 words (INT4_GROUPS): PER_ITEM values each, along K
        words = tl.program_id(1) * (BLOCK_K // PER_ITEM) + tl.arange(0, BLOCK_K // PER_ITEM)
        word_mask = (rows < n_rows)[:, None] & (words * PER_ITEM < n_cols)[None, :]
        stored = tl.load(w_ptr + row_ptrs * stride_wn + words[None, :], mask=word_mask, other=0)
        values = int4_values(stored, BLOCK_K)
    else:
        stored = tl.load(w_ptr + row_ptrs * stride_wn + cols[None, :], mask=mask, other=0)
        values = fp8_values(stored)
    # The tile's columns lie within one scale (`tile`): a scale a row.
    scale_ptrs = s_ptr + (rows // SCALE_ROWS).to(tl.int64) * stride_sn
    scales = tl.load(scale_ptrs + tl.program_id(1) * BLOCK_K // SCALE_COLS, mask=rows < n_rows)
    out = values * scales.to(tl.float32)[:, None]
    tl.store(
        out_ptr + row_ptrs * stride_on + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def applies(w) -> bool:
    """A 2-D quantized weight in a layout the kernels read (`kernels.quant.kernels_read`);
    expert stacks and other int4 groups keep `kernels.quant.dequantize`."""
    return is_quantized(w) and len(w.shape) == 2 and kernels_read(w)


def dequantize_weight(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The plain weight [N, K] in `dtype`, equal to `kernels.quant.dequantize(w, dtype)`."""
    if not applies(w):
        raise ValueError(
            f"one-pass dequantize takes a 2-D quantized weight the kernels read, got {type(w)}"
        )
    kw = kernel_weight(w)
    n_rows, n_cols = w.shape
    out = torch.empty(n_rows, n_cols, dtype=dtype, device=w.device)
    if n_rows == 0 or n_cols == 0:
        return out
    block_n, block_k = tile(kw.scale_cols)
    assert kw.format in (FP8_BLOCKS, INT4_GROUPS) and block_k % kw.per_item == 0
    grid = (triton.cdiv(n_rows, block_n), triton.cdiv(n_cols, block_k))
    _dequantize_kernel[grid](
        kw.stored,
        kw.scale,
        out,
        n_rows,
        n_cols,
        kw.stored.stride(0),
        kw.scale.stride(0),
        out.stride(0),
        FORMAT=kw.format,
        SCALE_ROWS=kw.scale_rows,
        SCALE_COLS=kw.scale_cols,
        PER_ITEM=kw.per_item,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out
