"""Decode attention over a paged KV cache (block tables), split along the sequence.

One new query token per sequence attends to its cached keys, which live in fixed-size blocks
scattered over the pool: slot = block * block_size + offset, K/V stored [slots, Hkv, D] (bf16 /
fp16 / fp32, or fp8 e4m3 with one fp32 scale per (slot, head), dequantised here).

At batch 1 there are only Hkv (e.g. 4) heads to spread over 132 SMs, so the sequence is split:
the split kernel runs one program per (sequence, kv head, split of the keys), all GQA query heads
of that kv head together as the rows of tensor-core dots (padded to 16), with an online softmax,
and writes a partial (max, sum, weighted V). The splits of each (sequence, query head) are then
merged, either by a second launch (the merge kernel) or, with `fused_merge`, inside the split
kernel by whichever split program of a (sequence, kv head) finishes last (one launch: a decode
step is launch-bound). fp32 throughout, one output write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_dependents, launch_options, pdl_supported, wait
from kernels.triton_env import interpreting, next_pow2

TILE = 64  # keys per inner step (one tl.dot)
PROGRAMS_WANTED = 2 * 132  # about two programs per SM of an H100/H200


@triton.jit
def _merge_splits(
    m_ptr,
    l_ptr,
    acc_ptr,
    row0,
    n_splits,
    out_ptr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
):
    """One query head's output out_ptr[:HEAD_DIM] from its n_splits partials, rows
    row0 .. row0 + n_splits - 1 of m/l [rows] and acc [rows, HEAD_DIM] (fp32)."""
    sp = tl.arange(0, SPLIT_PAD)
    d = tl.arange(0, D_PAD)
    sp_ok = sp < n_splits
    d_ok = d < HEAD_DIM
    row = row0 + sp
    # .cg: the partials come from other programs, so read them from L2, never a stale L1 line.
    m = tl.load(m_ptr + row, mask=sp_ok, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(l_ptr + row, mask=sp_ok, other=0.0, cache_modifier=".cg")
    acc = tl.load(
        acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
        mask=sp_ok[:, None] & d_ok[None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    top = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)  # empty splits (past the end) weigh 0
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
    tl.store(out_ptr + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _merge_if_last(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    counter_ptr,
    b,
    kvh,
    n_heads,
    n_splits,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
):
    """Called by every split program of (sequence b, kv head kvh) once its partials are stored:
    the one that arrives last merges the GROUP query heads' splits into out and resets the
    (sequence, kv head)'s counter to 0 for the next call (or CUDA-graph replay)."""
    tl.debug_barrier()  # every thread's partial stores are done before the release below
    count = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if count == n_splits - 1:
        for gi in range(GROUP):
            h = kvh * GROUP + gi
            _merge_splits(
                m_ptr,
                l_ptr,
                acc_ptr,
                (b * n_heads + h) * n_splits,
                n_splits,
                out_ptr + b * stride_ob + h * stride_oh,
                HEAD_DIM,
                D_PAD,
                SPLIT_PAD,
            )
        tl.store(counter_ptr, 0)


@triton.jit
def _kv_tile(
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    table_ptr,
    b,
    kvh,
    start,
    last,
    d,
    d_ok,
    stride_ks,
    stride_kh,
    stride_sks,
    stride_tb,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    FP8: tl.constexpr,
):
    """Token positions t [TILE] from `start`, their slots (through their blocks' table
    entries), and their keys and values [TILE, D_PAD] of kv head kvh (zero past `last`); with
    FP8 storage their per-slot scales [TILE] (else ones)."""
    t = start + tl.arange(0, TILE)
    valid = t < last
    phys = tl.load(table_ptr + b * stride_tb + t // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slots = phys * BLOCK_SIZE + t % BLOCK_SIZE
    kv_off = slots[:, None] * stride_ks + kvh * stride_kh + d[None, :]
    kv_mask = valid[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
    if FP8:
        k_scale = tl.load(ks_ptr + slots * stride_sks + kvh, mask=valid, other=0.0)
        v_scale = tl.load(vs_ptr + slots * stride_sks + kvh, mask=valid, other=0.0)
    else:
        k_scale = tl.full([TILE], 1.0, tl.float32)
        v_scale = tl.full([TILE], 1.0, tl.float32)
    return t, slots, k, v, k_scale, v_scale


@triton.jit
def _attend_tile(
    q, k, v, k_scale, v_scale, valid, m, l, acc, scale, FP8: tl.constexpr, INTERPRET: tl.constexpr
):
    """The online softmax's step over one tile of keys: (m, l, acc) updated."""
    if FP8:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if INTERPRET:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * scale  # [G, TILE], fp32 accumulation
    if FP8:
        s = s * k_scale[None, :]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    l = l * alpha + tl.sum(p, axis=1)
    if FP8:  # fold V's per-slot scale into the probabilities
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


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
    out_ptr,
    counters_ptr,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_sks,
    stride_tb,
    stride_ob,
    stride_oh,
    n_splits,
    scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    FP8: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    DIRECT: tl.constexpr,
    PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Program (b, kvh, split): GROUP query heads of kv head kvh over one split of sequence b's
    keys. Writes the partial (m, l, acc) rows (b * Hq + head) * n_splits + split; with
    FUSED_MERGE the last split program of (b, kvh) also merges them into out (counters: one int32
    per (b, kvh), 0 on entry and on exit); DIRECT (FUSED_MERGE with n_splits == 1) writes out
    straight away, with no partials and no counter."""
    launch_dependents(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g

    # The lengths and block tables are the step's inputs, and the keys are stored by earlier
    # steps except those of this step's rows: all of that, the first tile of keys included, is
    # read before the wait, so those loads overlap the previous kernel's tail. q, and the keys
    # and values this step's rows may have stored, are read after it. A row stores one token;
    # rows of one sequence (a prompt's tail) store consecutive tokens up to the last row's, so a
    # sequence's tokens stored in this step are among its last `batch` (the grid's rows).
    length = tl.load(lens_ptr + b)
    # The grid is fixed (so a CUDA graph can replay it); each sequence's keys are shared out
    # over its splits by its actual length, in whole tiles.
    per_split = tl.cdiv(tl.cdiv(length, n_splits), TILE) * TILE
    first = split * per_split
    last = tl.minimum(first + per_split, length)
    t, slots, k, v, k_scale, v_scale = _kv_tile(
        k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, b, kvh, first, last, d, d_ok,
        stride_ks, stride_kh, stride_sks, stride_tb, BLOCK_SIZE, TILE, FP8,
    )  # fmt: skip
    this_step = length - tl.num_programs(0)  # tokens from here on may be this step's
    wait(PDL)

    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if INTERPRET:  # the interpreter can't do bf16 arithmetic
        q = q.to(tl.float32)
    if (first < last) & (this_step < first + TILE):  # the first tile may hold this step's
        fresh = (t >= this_step) & (t < last)
        kv_off = slots[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        rows = fresh[:, None] & d_ok[None, :]
        k = tl.where(rows, tl.load(k_ptr + kv_off, mask=rows, other=0.0), k)
        v = tl.where(rows, tl.load(v_ptr + kv_off, mask=rows, other=0.0), v)
        if FP8:
            scale_off = slots * stride_sks + kvh
            k_scale = tl.where(fresh, tl.load(ks_ptr + scale_off, mask=fresh, other=0.0), k_scale)
            v_scale = tl.where(fresh, tl.load(vs_ptr + scale_off, mask=fresh, other=0.0), v_scale)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    if first < last:  # a split past the sequence's end keeps (-inf, 0, 0): it weighs nothing
        m, l, acc = _attend_tile(
            q, k, v, k_scale, v_scale, t < last, m, l, acc, scale, FP8, INTERPRET
        )
    for start in range(first + TILE, last, TILE):
        t, _, k, v, k_scale, v_scale = _kv_tile(
            k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, b, kvh, start, last, d, d_ok,
            stride_ks, stride_kh, stride_sks, stride_tb, BLOCK_SIZE, TILE, FP8,
        )  # fmt: skip
        m, l, acc = _attend_tile(
            q, k, v, k_scale, v_scale, t < last, m, l, acc, scale, FP8, INTERPRET
        )

    rows_ok = g_ok[:, None] & d_ok[None, :]
    if DIRECT:  # the only split holds the whole softmax (length >= 1, so l > 0 on real rows)
        out = acc / tl.where(g_ok, l, 1.0)[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=rows_ok,
        )
    else:
        n_heads = tl.num_programs(1) * GROUP
        row = (b * n_heads + heads) * n_splits + split
        tl.store(m_ptr + row, m, mask=g_ok)
        tl.store(l_ptr + row, l, mask=g_ok)
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=rows_ok)
        if FUSED_MERGE:
            _merge_if_last(
                m_ptr,
                l_ptr,
                acc_ptr,
                out_ptr,
                counters_ptr + b * tl.num_programs(1) + kvh,
                b,
                kvh,
                n_heads,
                n_splits,
                stride_ob,
                stride_oh,
                GROUP,
                HEAD_DIM,
                D_PAD,
                SPLIT_PAD,
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
    PDL: tl.constexpr,
):
    """Program (b, h): query head h of sequence b from the split kernel's partials."""
    launch_dependents(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    wait(PDL)  # the partials are the split kernel's
    _merge_splits(
        m_ptr,
        l_ptr,
        acc_ptr,
        (b * n_heads + h) * n_splits,
        n_splits,
        out_ptr + b * stride_ob + h * stride_oh,
        HEAD_DIM,
        D_PAD,
        SPLIT_PAD,
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
    fused_merge: bool = False,
    counters: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """q [B, Hq, D] (one token per sequence, RoPE applied); keys/values [slots, Hkv, D];
    block_tables [B, max_blocks] int; lengths [B] keys per sequence (the new token's included,
    so >= 1); fp8 storage: key_scales/value_scales [slots, Hkv] fp32. Returns [B, Hq, D] in q's
    dtype.

    fused_merge: one launch; the splits are merged by the last split program of each
    (sequence, kv head). counters: int32, at least B * Hkv elements on q's device, all 0; the
    call leaves them 0 again, so one buffer (zeroed once) serves every call and graph replay, as
    long as calls using it run one after another. None: a zeroed one is allocated per call.
    pdl: launch as part of a PDL chain (kernels/pdl.py) where the GPU supports it.

    The launch depends only on shapes and `n_splits` (default: from the table's width), never on
    the lengths' values, so it can be captured in a CUDA graph with a table as wide as the
    longest context and replayed for any lengths."""
    batch, n_heads, head_dim = q.shape
    n_kv = keys.shape[1]
    group = n_heads // n_kv
    q = q.contiguous()
    if n_splits is None:
        n_splits = default_splits(batch, n_kv, block_tables.shape[1] * block_size)
    out = torch.empty_like(q)
    direct = fused_merge and n_splits == 1
    if direct:  # no partials: `out` stands in for their (unused) pointers
        m = l = acc = out
    else:
        m = torch.empty(batch * n_heads * n_splits, device=q.device, dtype=torch.float32)
        l = torch.empty_like(m)
        acc = torch.empty(batch * n_heads * n_splits, head_dim, device=q.device, dtype=m.dtype)
    if fused_merge and not direct:
        counters = _check_counters(counters, batch * n_kv, q.device)
    else:
        counters = lengths  # placeholder pointer, unused
    fp8 = key_scales is not None
    ks = key_scales if fp8 else lengths  # placeholder pointers when unused
    vs = value_scales if fp8 else lengths
    split_pad = max(2, next_pow2(n_splits))
    options = launch_options(pdl and pdl_supported(q.device))
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
        out,
        counters,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        ks.stride(0) if fp8 else 0,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        n_splits,
        head_dim**-0.5,
        GROUP=group,
        GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        D_PAD=max(16, next_pow2(head_dim)),
        SPLIT_PAD=split_pad,
        BLOCK_SIZE=block_size,
        TILE=TILE,
        FP8=fp8,
        FUSED_MERGE=fused_merge,
        DIRECT=direct,
        PDL=bool(options),
        INTERPRET=interpreting(),
        **options,
    )
    if not fused_merge:
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
            SPLIT_PAD=split_pad,
            PDL=bool(options),
            **options,
        )
    return out


def _check_counters(counters: torch.Tensor | None, needed: int, device) -> torch.Tensor:
    """The fused merge's arrival counters: the caller's (checked) or a fresh zeroed buffer."""
    if counters is None:
        return torch.zeros(needed, device=device, dtype=torch.int32)
    if counters.dtype != torch.int32 or counters.numel() < needed or not counters.is_contiguous():
        raise ValueError(
            f"counters must be contiguous int32 with at least {needed} elements, "
            f"got {counters.dtype} {tuple(counters.shape)}"
        )
    if counters.device != device:
        raise ValueError(f"counters on {counters.device}, q on {device}")
    return counters


def default_splits(batch: int, n_kv_heads: int, max_tokens: int) -> int:
    """Splits per (sequence, kv head): enough programs to fill the GPU, but no more than the
    longest table has tiles of keys."""
    fill = max(1, PROGRAMS_WANTED // (batch * n_kv_heads))
    return max(1, min(fill, triton.cdiv(max_tokens, TILE)))
