"""Skinny matmul for decode-sized inputs: y [M, N] = x [M, K] @ w[N, K]^T with M <= 32.

At decode, a projection (q/k/v, o, lm_head) is one pass over its weight matrix: its speed is
the weight read. Each program streams a BLOCK_N x K stripe of w once, holds the few activation
rows in registers, and accumulates in fp32 on the tensor cores (rows padded to 16, which costs
nothing in a read-bound kernel).

`norm_linear` folds the residual add and RMSNorm that precede a projection into it: every
program recomputes the norm of the few rows it multiplies (a few KB from L2, against the
stripe of weights it streams), so the decode step saves the norm's launch. In a PDL chain
(kernels.pdl) the first weight tile is loaded before the wait for the previous kernel.

`heads_linear` is the q/k/v projection with the attention inputs as its epilogue: the last of
a head's programs to finish adds the head's partials and runs the q/k RMSNorm, RoPE and K/V
store of `kernels.fused_ops` on it, so the decode step saves that kernel's launch.

w may be quantized (kernels.quant): FP8 blocks or int4 groups, read as stored and dequantized
in registers (`quantized_dot`, shared with kernels.fused_moe); activations stay as they are.

A small matrix has too few output stripes to keep every SM streaming (the o projection of a
30B-A3B model is 128 stripes of 16 rows for 132 SMs, each walking K alone). `split_k` cuts K
into that many parts, each its own program; the last part of a stripe to finish adds the fp32
partials in a fixed order (the same bits on every run) and stores the output, as the attention
kernel's fused merge does. Its arrival counters are reset by that program, so one zeroed buffer
serves every launch and every CUDA-graph replay.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels import tuned
from kernels.counters import sm_count, zeroed_counters
from kernels.fused_ops import AttentionHeads, head_norm_rope_store
from kernels.pdl import launch_dependents, launch_options, pdl_supported, wait
from kernels.quant import Weight, format_name, is_quantized, kernel_weight
from kernels.quant_tiles import k_step, quantized_dot, scale_weights
from kernels.triton_env import interpreting, next_pow2

MAX_ROWS = 32
# The norm prologue reads a row in steps of up to this many values (a whole hidden row of the
# models served: one trip to L2 before the first dot).
MAX_NORM_BLOCK = 4096


@triton.jit
def _row_inverse_rms(
    x_ptr,
    delta_ptr,
    sum_ptr,
    offs_m,
    n_rows,
    k_in,
    stride_xm,
    eps,
    STORE_SUM,
    HAS_DELTA: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """1 / rms of each row of s = x + delta (rounded to x's dtype, as torch's add is); the
    program that owns the first output stripe also stores s. Every program waits for this
    before its first dot, so a row is read in steps of NORM_BLOCK (a whole row up to
    MAX_NORM_BLOCK: one trip to L2, not one per K step), and row by row: the dot pads the rows
    to ROWS, which the statistics need not carry."""
    offs_k = tl.arange(0, NORM_BLOCK)
    inv_rms = tl.zeros([ROWS], dtype=tl.float32)
    for row in range(0, n_rows):
        squares = tl.zeros([NORM_BLOCK], dtype=tl.float32)
        for k0 in range(0, k_in, NORM_BLOCK):
            mask = k0 + offs_k < k_in
            offs = row * stride_xm + k0 + offs_k
            s = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_DELTA:
                s += tl.load(delta_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                s = s.to(x_ptr.dtype.element_ty)
                if STORE_SUM:
                    tl.store(sum_ptr + offs, s, mask=mask)
                s = s.to(tl.float32)
            squares += s * s
        row_inv = tl.rsqrt(tl.sum(squares, axis=0) / k_in + eps)
        inv_rms = tl.where(offs_m == row, row_inv, inv_rms)
    return inv_rms


@triton.jit
def _activations(
    x_ptr,
    delta_ptr,
    nw_ptr,
    inv_rms,
    offs_m,
    mask_m,
    k0,
    k_in,
    stride_xm,
    NORM: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """The K step at k0 of the rows the dot multiplies: x itself, or rms_norm(x + delta) * nw
    rounded as `kernels.fused_ops.add_rms_norm` rounds it. fp32 under the interpreter."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < k_in
    mask = mask_m[:, None] & mask_k[None, :]
    offs = offs_m[:, None] * stride_xm + offs_k[None, :]
    a = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if NORM:
        dtype = x_ptr.dtype.element_ty
        s = a.to(tl.float32)
        if HAS_DELTA:
            s = (s + tl.load(delta_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
            s = s.to(tl.float32)
        normed = (s * inv_rms[:, None]).to(dtype).to(tl.float32)
        nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        a = (nw[None, :] * normed).to(dtype)
    if DOT_F32:  # the interpreter can't multiply bf16
        a = a.to(tl.float32)
    return a


@triton.jit
def _accumulate(
    a,
    w,
    s_rows,
    k0,
    k_in,
    acc,
    FORMAT: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_WEIGHTS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """acc + a @ w^T for the loaded weight tile of the K step at k0 (plain or quantized)."""
    if FORMAT == 0:
        if INTERPRET:  # the interpreter can't multiply bf16
            w = w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc)
    else:
        acc = quantized_dot(a, w, s_rows, k0, k_in, acc, FORMAT, SCALE_COLS, BLOCK_K, SCALE_WEIGHTS)
    return acc


@triton.jit
def _skinny_kernel(
    x_ptr,
    delta_ptr,
    nw_ptr,
    sum_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    counters_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_dst_ptr,
    v_dst_ptr,
    slots_ptr,
    n_rows,
    n_out,
    k_in,
    k_part,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    stride_cs,
    stride_dst_slot,
    n_q_heads,
    n_kv_heads,
    eps,
    head_eps,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
    INTERPRET: tl.constexpr,
    FORMAT: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    PER_ITEM: tl.constexpr,
    SCALE_WEIGHTS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    """y = x @ w^T for stripe program_id(0) of the outputs over part program_id(1) of K. With
    HEAD_DIM (`heads_linear`) the outputs are the q/k/v heads and y is not written: every
    program stores its fp32 partial, and the last of a head's HEAD_DIM // BLOCK_N stripes x
    SPLIT_K parts to arrive adds the head's partials in a fixed order and hands the head to
    `kernels.fused_ops.head_norm_rope_store` (q/k RMSNorm, RoPE, the K/V store)."""
    launch_dependents(PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_start = pid_k * k_part  # this program's part of K: [k_start, k_end)
    k_end = tl.minimum(k_in, k_start + k_part)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS)
    offs_c = tl.arange(0, BLOCK_K // PER_ITEM)  # stored items (int4: words) of a step
    mask_n = offs_n < n_out
    mask_m = offs_m < n_rows
    w_ptrs = (
        w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start // PER_ITEM + offs_c)[None, :]
    )
    rows = tl.minimum(offs_n, n_out - 1)  # masked rows read a real scale
    s_rows = s_ptr + (rows // SCALE_ROWS).to(tl.int64) * stride_sn
    # The first weight tile depends on nothing the previous kernel writes: in flight before
    # the wait.
    w = tl.load(
        w_ptrs, mask=mask_n[:, None] & (k_start + offs_c * PER_ITEM < k_end)[None, :], other=0
    )
    wait(PDL)
    inv_rms = tl.zeros([ROWS], dtype=tl.float32)
    if NORM:
        inv_rms = _row_inverse_rms(
            x_ptr,
            delta_ptr,
            sum_ptr,
            offs_m,
            n_rows,
            k_in,
            stride_xm,
            eps,
            (pid == 0) & (pid_k == 0),
            HAS_DELTA,
            NORM_BLOCK,
            ROWS,
        )
    a = _activations(
        x_ptr,
        delta_ptr,
        nw_ptr,
        inv_rms,
        offs_m,
        mask_m,
        k_start,
        k_end,
        stride_xm,
        NORM,
        HAS_DELTA,
        BLOCK_K,
        INTERPRET,
    )
    acc = _accumulate(
        a,
        w,
        s_rows,
        k_start,
        k_in,
        tl.zeros([ROWS, BLOCK_N], dtype=tl.float32),
        FORMAT,
        SCALE_COLS,
        BLOCK_K,
        SCALE_WEIGHTS,
        INTERPRET,
    )
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        w_ptrs += BLOCK_K // PER_ITEM
        mask_w = mask_n[:, None] & (k0 + offs_c * PER_ITEM < k_end)[None, :]
        w = tl.load(w_ptrs, mask=mask_w, other=0)
        a = _activations(
            x_ptr,
            delta_ptr,
            nw_ptr,
            inv_rms,
            offs_m,
            mask_m,
            k0,
            k_end,
            stride_xm,
            NORM,
            HAS_DELTA,
            BLOCK_K,
            INTERPRET,
        )
        acc = _accumulate(
            a, w, s_rows, k0, k_in, acc, FORMAT, SCALE_COLS, BLOCK_K, SCALE_WEIGHTS, INTERPRET
        )
    mask_y = mask_m[:, None] & mask_n[None, :]
    offs_y = offs_m[:, None] * n_out + offs_n[None, :]  # of a partial [n_rows, n_out]
    if HEAD_DIM > 0:
        tl.store(part_ptr + pid_k * n_rows * n_out + offs_y, acc, mask=mask_y)
        tl.debug_barrier()  # every thread's partial stored before the count says so
        head = pid * BLOCK_N // HEAD_DIM
        count = tl.atomic_add(counters_ptr + head, 1, sem="acq_rel")
        if count == SPLIT_K * (HEAD_DIM // BLOCK_N) - 1:
            lo, hi = _head_from_partials(
                part_ptr, b_ptr, head, offs_m, mask_m, n_rows, n_out, x_ptr.dtype.element_ty,
                HAS_BIAS, ROWS, SPLIT_K, HEAD_DIM, HALF,
            )  # fmt: skip
            head_norm_rope_store(
                lo, hi, head, offs_m.to(tl.int64), mask_m,
                qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, k_dst_ptr, v_dst_ptr, slots_ptr,
                stride_cs, stride_dst_slot, n_q_heads, n_kv_heads, head_eps, HEAD_DIM, HALF,
            )  # fmt: skip
            tl.store(counters_ptr + head, 0)  # ready for the next launch and every graph replay
    elif SPLIT_K > 1:
        tl.store(part_ptr + pid_k * n_rows * n_out + offs_y, acc, mask=mask_y)
        tl.debug_barrier()  # every thread's partial stored before the count says so
        count = tl.atomic_add(counters_ptr + pid, 1, sem="acq_rel")
        if count == SPLIT_K - 1:
            acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
            for part in range(SPLIT_K):  # in order, whichever part came last
                acc += tl.load(
                    part_ptr + part * n_rows * n_out + offs_y,
                    mask=mask_y,
                    other=0.0,
                    cache_modifier=".cg",  # from L2: other SMs wrote them
                )
            _store_output(acc, b_ptr, y_ptr, offs_m, offs_n, mask_n, mask_y, stride_ym, HAS_BIAS)
            tl.store(counters_ptr + pid, 0)  # ready for the next launch and every graph replay
    else:
        _store_output(acc, b_ptr, y_ptr, offs_m, offs_n, mask_n, mask_y, stride_ym, HAS_BIAS)


@triton.jit
def _head_from_partials(
    part_ptr,
    b_ptr,
    head,
    offs_m,
    mask_m,
    n_rows,
    n_out,
    dtype: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
):
    """Head `head` of the q/k/v projection as halves lo, hi [ROWS, HALF]: its SPLIT_K fp32
    partials added in order, the bias, rounded to `dtype` as the projection's output is."""
    d = tl.arange(0, HALF)
    offs_lo = offs_m[:, None] * n_out + head * HEAD_DIM + d[None, :]
    lo = tl.zeros([ROWS, HALF], dtype=tl.float32)
    hi = tl.zeros([ROWS, HALF], dtype=tl.float32)
    for part in range(SPLIT_K):  # in order, whichever part came last
        part_lo = part_ptr + part * n_rows * n_out + offs_lo
        # .cg: from L2, other SMs wrote them
        lo += tl.load(part_lo, mask=mask_m[:, None], other=0.0, cache_modifier=".cg")
        hi += tl.load(part_lo + HALF, mask=mask_m[:, None], other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        lo += tl.load(b_ptr + head * HEAD_DIM + d).to(tl.float32)[None, :]
        hi += tl.load(b_ptr + head * HEAD_DIM + HALF + d).to(tl.float32)[None, :]
    return lo.to(dtype).to(tl.float32), hi.to(dtype).to(tl.float32)


@triton.jit
def _store_output(acc, b_ptr, y_ptr, offs_m, offs_n, mask_n, mask_y, stride_ym, HAS_BIAS):
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_y,
    )


def skinny_linear(
    x: torch.Tensor,
    w: Weight,
    bias: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pdl: bool = False,
    split_k: int | None = None,
    scale_weights: bool | None = None,
) -> torch.Tensor:
    """F.linear(x, w, bias) for x [M, K] with M <= MAX_ROWS rows, in x's dtype (fp32
    accumulation).

    w [N, K] is a tensor or a quantized weight (kernels.quant.kernels_read); a quantized weight's
    K steps shrink to fit its scales (`k_step`). `pdl`: launched as a link of a PDL chain.
    `split_k`: parts of K in programs of their own. `scale_weights`: a quantized weight's
    scales on its values rather than on the dot's partial products (kernels.quant_tiles). A
    tile argument left None comes from the tuned table of w's format and size
    (`tuned_tiles`), else the defaults (DEFAULT_TILES, split by `default_split_k`)."""
    tiles = _Tiles(block_n, block_k, num_warps, num_stages, split_k, scale_weights)
    _, y = _launch(x, None, None, 0.0, w, bias, tiles, pdl)
    return y


def norm_linear(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w: Weight,
    bias: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pdl: bool = False,
    split_k: int | None = None,
    scale_weights: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, F.linear(rms_norm(s) * norm_weight, w, bias)) with s = x + delta (s = x when delta
    is None), in one launch: `kernels.fused_ops.add_rms_norm` followed by `skinny_linear`, with
    the same roundings. x, delta [M, K] with M <= MAX_ROWS; tiles as for `skinny_linear`."""
    tiles = _Tiles(block_n, block_k, num_warps, num_stages, split_k, scale_weights)
    return _launch(x, delta, norm_weight, eps, w, bias, tiles, pdl)


def heads_linear(
    x: torch.Tensor,
    w: Weight,
    bias: torch.Tensor | None,
    heads: AttentionHeads,
    delta: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pdl: bool = False,
    split_k: int | None = None,
    scale_weights: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, q): `heads.store(F.linear(a, w, bias))` in one launch, the q/k/v projection with the
    attention inputs as its epilogue (each head handled by the last of its programs), where
    a = x, or a = rms_norm(s) * norm_weight with s = x + delta when norm_weight is given (as
    `norm_linear`; s = x without delta). Stripes are at most a head wide; tiles as for
    `skinny_linear`."""
    tiles = _Tiles(block_n, block_k, num_warps, num_stages, split_k, scale_weights)
    return _launch(x, delta, norm_weight, eps, w, bias, tiles, pdl, heads)


@dataclasses.dataclass(frozen=True)
class _Tiles:
    block_n: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    split_k: int | None = None  # None: default_split_k
    # Quantized weights: scales on the weights before the dot, or on its partial products
    # (kernels.quant_tiles.quantized_dot); None: the format's way (scale_weights).
    scale_weights: bool | None = None

    def over(self, base: dict) -> _Tiles:
        """These tiles, each one left None taken from `base` (tuned_tiles)."""
        given = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return _Tiles(**{**base, **given})


_TILE_FIELDS = tuple(f.name for f in dataclasses.fields(_Tiles))
# Untuned sizes: 16-row stripes over 256 columns a step, K split by default_split_k.
DEFAULT_TILES = {"block_n": 16, "block_k": 256, "num_warps": 4, "num_stages": 3}


def table_name(weights: str, n_out: int, k_in: int) -> str:
    """The tuned table of a GEMV over an [n_out, k_in] weight of format `weights`
    (kernels.quant.format_name), written by `python -m engine.bench.projections --tune`:
    {"device": ..., "configs": {rows: {"block_n", "block_k", "num_warps", "num_stages",
    "split_k", optionally "scale_weights"}}}; a bf16 table's entries also say whether they
    beat cuBLAS ("beats_library")."""
    return f"gemv_{weights}_N{n_out}_K{k_in}.json"


def _tuned(weights: str, n_out: int, k_in: int, rows: int) -> dict:
    table = tuned.load(table_name(weights, n_out, k_in)) or {}
    return tuned.nearest(table.get("configs"), rows) or {}


def tuned_tiles(weights: str, n_out: int, k_in: int, rows: int) -> dict:
    """The tuned tiles of this GEMV at the nearest tuned row count, else DEFAULT_TILES."""
    tiles = {k: v for k, v in _tuned(weights, n_out, k_in, rows).items() if k in _TILE_FIELDS}
    return {**DEFAULT_TILES, **tiles}


def is_tuned(weights: str, n_out: int, k_in: int) -> bool:
    """Whether a tuned table exists for this GEMV (any row count)."""
    return bool((tuned.load(table_name(weights, n_out, k_in)) or {}).get("configs"))


def beats_library(n_out: int, k_in: int, rows: int) -> bool:
    """Whether the tuned GEMV over a bf16 [n_out, k_in] weight was faster than the library's
    GEMM (cuBLAS) at the nearest tuned row count; untuned sizes stay with the library."""
    return bool(_tuned("bf16", n_out, k_in, rows).get("beats_library", False))


# Enough programs to keep every SM streaming: a few per SM (BENCHMARKS.md, "Splitting K in the
# skinny GEMV": the default tile with this split, against the same tile unsplit and the sweep).
PROGRAMS_PER_SM = 4
# The arrival counters, one per output stripe of a split K, or per head with the heads epilogue
# (the last arrival resets its own).
COUNTERS_USER = "gemv split-K"


def default_split_k(n_stripes: int, k_steps: int, device: torch.device) -> int:
    """Parts of K for a GEMV of `n_stripes` output stripes and `k_steps` K steps: none on the
    CPU (the interpreter), else as many as bring the programs up to PROGRAMS_PER_SM per SM,
    each part keeping at least two K steps."""
    if device.type != "cuda" or interpreting():
        return 1
    target = PROGRAMS_PER_SM * sm_count(device.index or 0)
    return max(1, min(-(-target // n_stripes), k_steps // 2))


def _launch(x, delta, norm_weight, eps, w, bias, tiles: _Tiles, pdl: bool, heads=None):
    n_rows, k_in = x.shape
    n_out = w.shape[0]
    assert 0 < n_rows <= MAX_ROWS and len(w.shape) == 2 and w.shape[1] == k_in
    assert is_quantized(w) or w.stride(1) == 1, "a plain w must be contiguous along K"
    kw = kernel_weight(w)
    tiles = tiles.over(tuned_tiles(format_name(w), n_out, k_in, n_rows))
    block_n = tiles.block_n
    head_dim = heads.head_dim if heads is not None else 0  # 0: a plain output
    block_k = k_step(tiles.block_k, kw)
    k_steps = triton.cdiv(k_in, block_k)
    # K is split as the plain GEMV of these tiles splits it, so both sum alike.
    split_k = tiles.split_k or default_split_k(triton.cdiv(n_out, block_n), k_steps, x.device)
    if heads is not None:  # a stripe within one head (both powers of two)
        block_n = min(block_n, head_dim)
    n_stripes = triton.cdiv(n_out, block_n)
    k_part = triton.cdiv(k_steps, max(1, min(split_k, k_steps))) * block_k
    split_k = triton.cdiv(k_in, k_part)  # no empty part
    if split_k > 1 or heads is not None:
        partials = torch.empty(split_k, n_rows, n_out, dtype=torch.float32, device=x.device)
        counters = zeroed_counters(x.device, n_stripes, COUNTERS_USER)
    else:
        partials = counters = x  # placeholders, unused
    x = x.contiguous()
    norm = norm_weight is not None
    if delta is not None:
        assert norm and delta.shape == x.shape
        delta = delta.contiguous()
        total = torch.empty_like(x)
    else:
        total = x
    chained = pdl and pdl_supported(x.device)
    common = dict(
        HAS_BIAS=bias is not None,
        NORM=norm,
        HAS_DELTA=delta is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ROWS=max(16, next_pow2(n_rows)),
        INTERPRET=interpreting(),
        FORMAT=kw.format,
        SCALE_ROWS=kw.scale_rows,
        SCALE_COLS=kw.scale_cols,
        PER_ITEM=kw.per_item,
        SCALE_WEIGHTS=scale_weights(kw, tiles.scale_weights),
        SPLIT_K=split_k,
        NORM_BLOCK=min(next_pow2(k_in), MAX_NORM_BLOCK) if norm else 1,
        PDL=chained,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **launch_options(chained),
    )
    inputs = (
        x,
        delta if delta is not None else x,
        norm_weight if norm else x,
        total,
        kw.stored,
        kw.scale,
        bias if bias is not None else kw.stored,
    )
    if heads is None:
        y = out = torch.empty(n_rows, n_out, dtype=x.dtype, device=x.device)
        head_ptrs, head_ints, head_eps = (x,) * 8, (0, 0, 0, 0), 0.0  # placeholders, unused
    else:  # y (and its stride) unused: a placeholder
        y = x
        out, head_ptrs, head_ints = heads.kernel_args((n_rows, n_out), x.dtype)
        head_eps = heads.eps
    _skinny_kernel[(n_stripes, split_k)](
        *inputs,
        y,
        partials,
        counters,
        *head_ptrs,
        n_rows,
        n_out,
        k_in,
        k_part,
        x.stride(0),
        kw.stored.stride(0),
        kw.scale.stride(0),
        y.stride(0),
        *head_ints,
        eps,
        head_eps,
        HEAD_DIM=head_dim,
        HALF=head_dim // 2,
        **common,
    )
    return total, out
