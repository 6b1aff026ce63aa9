"""Decode attention over a paged KV cache (block tables), split along the sequence.

One new query token per sequence attends to its cached keys, which live in fixed-size blocks
scattered over the pool: slot = block * block_size + offset, K/V stored [slots, Hkv, D] (bf16 /
fp16 / fp32, or fp8 e4m3 with one fp32 scale per (slot, head), dequantised here).

At batch 1 there are only Hkv (e.g. 4) heads to spread over 132 SMs, so the sequence is split:
kernel 1 runs one program per (sequence, kv head, split of the keys), all GQA query heads of
that kv head together as the rows of tensor-core dots (padded to 16), with an online softmax,
and writes a partial (max, sum, weighted V);
kernel 2 merges the splits of each (sequence, query head). fp32 throughout, one output write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_env import interpreting, next_pow2

TILE = 64  # keys per inner step (one tl.dot)
PROGRAMS_WANTED = 2 * 132  # about two programs per SM of an H100/H200


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    table_ptr,
    lens_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_sks,
    stride_tb,
    n_splits,
    scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + b)
    # The grid is fixed (so a CUDA graph can replay it); each sequence's keys are shared out
    # over its splits by its actual length, in whole tiles.
    per_split = tl.cdiv(tl.cdiv(length, n_splits), TILE) * TILE
    first = split * per_split
    last = tl.minimum(first + per_split, length)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if INTERPRET:  # the interpreter can't do bf16 arithmetic
        q = q.to(tl.float32)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for start in range(first, last, TILE):
        # TILE tokens at once; each token's slot comes through its block's table entry.
        t = start + tl.arange(0, TILE)
        valid = t < last
        phys = tl.load(table_ptr + b * stride_tb + t // BLOCK_SIZE, mask=valid, other=0).to(
            tl.int64
        )
        slots = phys * BLOCK_SIZE + t % BLOCK_SIZE
        kv_off = slots[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        kv_mask = valid[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if INTERPRET:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale  # [G, TILE], fp32 accumulation
        if FP8:
            s = s * tl.load(ks_ptr + slots * stride_sks + kvh, mask=valid, other=0.0)[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        if FP8:  # fold V's per-slot scale into the probabilities
            p = p * tl.load(vs_ptr + slots * stride_sks + kvh, mask=valid, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    row = (b * (tl.num_programs(1) * GROUP) + heads) * n_splits + split
    tl.store(m_ptr + row, m, mask=g_ok)
    tl.store(l_ptr + row, l, mask=g_ok)
    tl.store(
        acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :]
    )


@triton.jit
def _merge_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    n_heads,
    n_splits,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLIT_PAD)
    d = tl.arange(0, D_PAD)
    sp_ok = sp < n_splits
    row = (b * n_heads + h) * n_splits + sp
    m = tl.load(m_ptr + row, mask=sp_ok, other=float("-inf"))
    l = tl.load(l_ptr + row, mask=sp_ok, other=0.0)
    acc = tl.load(
        acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
        mask=sp_ok[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    top = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)  # empty splits (past the end) weigh 0
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def paged_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    n_splits: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (one token per sequence, RoPE applied); keys/values [slots, Hkv, D];
    block_tables [B, max_blocks] int; lengths [B] keys per sequence (the new token's included);
    fp8 storage: key_scales/value_scales [slots, Hkv] fp32. Returns [B, Hq, D] in q's dtype.

    The launch depends only on shapes and `n_splits` (default: from the table's width), never on
    the lengths' values, so it can be captured in a CUDA graph with a table as wide as the
    longest context and replayed for any lengths."""
    batch, n_heads, head_dim = q.shape
    n_kv = keys.shape[1]
    group = n_heads // n_kv
    q = q.contiguous()
    if n_splits is None:
        n_splits = default_splits(batch, n_kv, block_tables.shape[1] * block_size)
    m = torch.empty(batch * n_heads * n_splits, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(batch * n_heads * n_splits, head_dim, device=q.device, dtype=torch.float32)
    fp8 = key_scales is not None
    ks = key_scales if fp8 else m  # placeholder pointers when unused
    vs = value_scales if fp8 else m
    _split_kernel[(batch, n_kv, n_splits)](
        q,
        keys,
        values,
        ks,
        vs,
        block_tables,
        lengths,
        m,
        l,
        acc,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        ks.stride(0) if fp8 else 0,
        block_tables.stride(0),
        n_splits,
        head_dim**-0.5,
        GROUP=group,
        GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        D_PAD=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=block_size,
        TILE=TILE,
        FP8=fp8,
        INTERPRET=interpreting(),
    )
    out = torch.empty_like(q)
    _merge_kernel[(batch, n_heads)](
        m,
        l,
        acc,
        out,
        out.stride(0),
        out.stride(1),
        n_heads,
        n_splits,
        HEAD_DIM=head_dim,
        D_PAD=next_pow2(head_dim),
        SPLIT_PAD=max(2, next_pow2(n_splits)),
    )
    return out


def default_splits(batch: int, n_kv_heads: int, max_tokens: int) -> int:
    """Splits per (sequence, kv head): enough programs to fill the GPU, but no more than the
    longest table has tiles of keys."""
    fill = max(1, PROGRAMS_WANTED // (batch * n_kv_heads))
    return max(1, min(fill, triton.cdiv(max_tokens, TILE)))
