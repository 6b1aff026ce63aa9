"""Warp decode's work items, the device code both of its launch forms share (kernels.warp_decode):
the two-kernel pair runs one item per program, the persistent kernel many per program.

- `gate_up_item`: silu(gate) * up of a block of intermediate rows of one routed slot, streamed
  over H with fp32 accumulation, stored in the activations' dtype.
- `down_item`: a block of hidden outputs of one token: the down rows of all its top-k experts
  at once (the slot is a tile dimension), each routing weight folded into the fp32 accumulator;
  its first weights are loaded before it waits for the token's activations (ACTS_*).

Weights are read as stored (bf16, FP8 blocks, int4 groups: FORMAT) and dequantized in
registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.quant_tiles import (
    fp8_column_scales,
    fp8_slot_column_scales,
    fp8_values,
    int4_plane,
    int4_plane_scale,
    int4_upper_half,
)


@triton.jit
def prefetch_l2(ptrs, EVICT_LAST: tl.constexpr = False):
    """Ask L2 for the line holding each pointer; nothing comes back to registers."""
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;",
            "=r,l",
            [ptrs.to(tl.int64)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
            "=r,l",
            [ptrs.to(tl.int64)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _int4_gate_up_sums(gate, up, x_row, cols, n_cols, EVEN: tl.constexpr):
    """Sums of q * x over a step, the scales left out, for int4 gate and up words [R, C]; `cols`
    [C] are the step's columns 8c, x_row points at x's column 0. Plane j (value j of every word)
    holds columns 8c + j, so it meets x's columns 8c + j, loaded strided: no word is expanded
    to its eight columns, and x is small enough to come from L1. fp32 [R, C] each."""
    gate_q = tl.zeros(gate.shape, dtype=tl.float32)
    up_q = tl.zeros(up.shape, dtype=tl.float32)
    gate_upper = int4_upper_half(gate)
    up_upper = int4_upper_half(up)
    for j in tl.static_range(8):
        if EVEN:
            xj = tl.load(x_row + cols + j)
        else:
            xj = tl.load(x_row + cols + j, mask=cols + j < n_cols, other=0.0)
        xj = (xj.to(tl.float32) * int4_plane_scale(j))[None, :]
        gate_q += int4_plane(gate, gate_upper, j) * xj
        up_q += int4_plane(up, up_upper, j) * xj
    return gate_q, up_q


@triton.jit
def _int4_row_scales(s_ptrs, h0, mask_i, n_cols, STEP_COLS: tl.constexpr, SCALE_COLS: tl.constexpr):
    """The scales of a gate/up step of STEP_COLS columns from h0 (s_ptrs [R]: each row's
    scales): one a row [R, 1] where the step lies within a group, else one a word [R, C] (a step
    of whole groups, a power of two of columns each, so that a step stays as many bytes as a
    bf16 tile's where groups are narrow). Those are loaded once a row and group and spread over
    the group's words: a gather per word costs about 15% more instructions (BENCHMARKS.md).
    `_int4_step_scales` is the same for the down kernel's [K, BLOCK_H] rows."""
    tl.static_assert(STEP_COLS > SCALE_COLS or SCALE_COLS % STEP_COLS == 0)
    if STEP_COLS <= SCALE_COLS:
        scales = tl.load(s_ptrs + h0 // SCALE_COLS, mask=mask_i, other=0.0).to(tl.float32)
        scales = scales[:, None]
    else:
        G: tl.constexpr = STEP_COLS // SCALE_COLS
        groups = h0 // SCALE_COLS + tl.arange(0, G)
        mask = mask_i[:, None] & (groups * SCALE_COLS < n_cols)[None, :]
        per_group = tl.load(s_ptrs[:, None] + groups[None, :], mask=mask, other=0.0)
        scales = tl.reshape(
            tl.broadcast_to(
                per_group.to(tl.float32)[:, :, None], [mask_i.shape[0], G, SCALE_COLS // 8]
            ),
            [mask_i.shape[0], STEP_COLS // 8],
        )
    return scales


@triton.jit
def gate_up_item(
    x_ptr,
    w_ptr,
    s_ptr,
    ids_ptr,
    out_ptr,
    slot,
    pid_i,
    hidden,
    inter,
    top_k,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_I: tl.constexpr,
    EVEN_H: tl.constexpr,
    FORMAT: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    PER_ITEM: tl.constexpr,
    EVICT: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    """One gate/up work item: silu(gate) * up of rows pid_i * BLOCK_I .. of routed slot `slot`'s
    expert, over all of H, stored into out[slot]. Returns the expert."""
    token = slot // top_k
    expert = tl.load(ids_ptr + slot).to(tl.int64)

    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_H // PER_ITEM)  # stored items (int4: words) of a step
    mask_i = offs_i < inter
    gate_ptrs = w_ptr + expert * stride_we + offs_i[:, None] * stride_wn + offs_c[None, :]
    up_ptrs = gate_ptrs + inter * stride_wn
    x_row = x_ptr + token * stride_xt
    x_ptrs = x_row + offs_h
    if FORMAT == 1:  # FP8: tiles never straddle two blocks' rows; the scales are folded into x
        gate_s_ptr = s_ptr + expert * stride_se + (pid_i * BLOCK_I // SCALE_ROWS) * stride_sn
        up_s_ptr = (
            s_ptr + expert * stride_se + ((inter + pid_i * BLOCK_I) // SCALE_ROWS) * stride_sn
        )
    else:  # int4: a scale per row and group
        gate_s_ptr = s_ptr + expert * stride_se + offs_i * stride_sn
        up_s_ptr = gate_s_ptr + inter * stride_sn

    # 2-D accumulators: one cross-lane reduction at the end instead of one per step (int4: a
    # column per word, the sum over its eight values being formed in the step).
    acc_gate = tl.zeros([BLOCK_I, BLOCK_H // PER_ITEM], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_I, BLOCK_H // PER_ITEM], dtype=tl.float32)
    for h0 in tl.range(0, hidden, BLOCK_H, num_stages=LOOP_STAGES):
        if EVEN_H:
            if FORMAT != 2:  # int4 reads x plane by plane (_int4_gate_up_sums)
                xv = tl.load(x_ptrs).to(tl.float32)
            if EVEN_I:
                gate = tl.load(gate_ptrs, eviction_policy=EVICT)
                up = tl.load(up_ptrs, eviction_policy=EVICT)
            else:
                gate = tl.load(gate_ptrs, mask=mask_i[:, None], other=0, eviction_policy=EVICT)
                up = tl.load(up_ptrs, mask=mask_i[:, None], other=0, eviction_policy=EVICT)
        else:
            mask_h = (h0 + offs_h) < hidden
            mask_w = mask_i[:, None] & ((h0 + offs_c * PER_ITEM) < hidden)[None, :]
            if FORMAT != 2:
                xv = tl.load(x_ptrs, mask=mask_h, other=0.0).to(tl.float32)
            gate = tl.load(gate_ptrs, mask=mask_w, other=0, eviction_policy=EVICT)
            up = tl.load(up_ptrs, mask=mask_w, other=0, eviction_policy=EVICT)
        if FORMAT == 0:
            acc_gate += gate.to(tl.float32) * xv[None, :]
            acc_up += up.to(tl.float32) * xv[None, :]
        elif FORMAT == 1:
            # A tile may span several blocks' columns (not rows): a scale per column of x.
            gate_x = xv * fp8_column_scales(gate_s_ptr, h0, hidden, BLOCK_H, SCALE_COLS)
            up_x = xv * fp8_column_scales(up_s_ptr, h0, hidden, BLOCK_H, SCALE_COLS)
            acc_gate += fp8_values(gate) * gate_x[None, :]
            acc_up += fp8_values(up) * up_x[None, :]
        else:
            # A word's eight products are summed, then scaled by its (row, group) scale.
            cols = h0 + 8 * offs_c
            gate_q, up_q = _int4_gate_up_sums(gate, up, x_row, cols, hidden, EVEN_H)
            acc_gate += gate_q * _int4_row_scales(
                gate_s_ptr, h0, mask_i, hidden, BLOCK_H, SCALE_COLS
            )
            acc_up += up_q * _int4_row_scales(up_s_ptr, h0, mask_i, hidden, BLOCK_H, SCALE_COLS)
        x_ptrs += BLOCK_H
        gate_ptrs += BLOCK_H // PER_ITEM
        up_ptrs += BLOCK_H // PER_ITEM

    gate_sum = tl.sum(acc_gate, axis=1)
    up_sum = tl.sum(acc_up, axis=1)
    act = gate_sum / (1.0 + tl.exp(-gate_sum)) * up_sum
    tl.store(out_ptr + slot * inter + offs_i, act.to(out_ptr.dtype.element_ty), mask=mask_i)
    return expert


@triton.jit
def _down_tile(w, FORMAT: tl.constexpr):
    """A loaded bf16 or FP8 down tile [K, BLOCK_H, columns] -> fp32; FP8's scales are folded
    into the activations instead (per slot and column). int4 goes by `_int4_down_step`."""
    # One return: compiled Triton needs every return of a function to have one type, even in
    # branches a constexpr rules out.
    if FORMAT == 1:
        values = fp8_values(w)
    else:
        values = w.to(tl.float32)
    return values


@triton.jit
def _int4_down_step(
    w, scales, a_rows, cols, n_cols, mask_k, route_w, EVEN: tl.constexpr, ACT_CACHE: tl.constexpr
):
    """One step of int4 down words w [K, BLOCK_H, C] -> its fp32 [K, BLOCK_H, C] share of the
    accumulator. `cols` [C] are the step's columns 8c; a_rows [K, 1] points at each slot's
    activation row; `scales` are each word's (row, group) scale, [K, BLOCK_H, 1] where the step
    lies within one group, else [K, BLOCK_H, C].

    Plane j (value j of every word) holds columns 8c + j, so it meets the slots' activations of
    those columns, loaded strided (they come from L1) and times the routing weight and
    `int4_plane_scale(j)` in fp32: a [K, C] tile. No word is expanded to its eight columns, and
    the scale multiplies the sum of a word's eight products once. ACT_CACHE: the activations'
    cache modifier (".cg" where other SMs wrote them during this launch)."""
    part = tl.zeros(w.shape, dtype=tl.float32)
    upper = int4_upper_half(w)
    for j in tl.static_range(8):
        if EVEN:
            a = tl.load(a_rows + (cols + j)[None, :], cache_modifier=ACT_CACHE)
        else:
            mask_a = mask_k[:, None] & (cols + j < n_cols)[None, :]
            a = tl.load(
                a_rows + (cols + j)[None, :], mask=mask_a, other=0.0, cache_modifier=ACT_CACHE
            )
        a = a.to(tl.float32) * (route_w * int4_plane_scale(j))[:, None]
        part += int4_plane(w, upper, j) * a[:, None, :]
    return part * scales


@triton.jit
def _int4_step_scales(
    s_ptrs, mask_kh, i0, cols, n_cols, STEP_COLS: tl.constexpr, SCALE_COLS: tl.constexpr
):
    """The scales of an int4 down step of STEP_COLS columns from i0, `cols` (8c) its words'
    first columns; s_ptrs [K, BLOCK_H] point at each row's scales. One per row where the step
    lies within a group (i0 is a multiple of a step that divides the group), else one per word:
    loaded once a row and group and spread over its words where the step holds whole groups of
    a power of two of columns, else gathered word by word (a preload over groups of another
    width)."""
    tl.static_assert(STEP_COLS > SCALE_COLS or SCALE_COLS % STEP_COLS == 0)
    if STEP_COLS <= SCALE_COLS:
        scales = tl.load(s_ptrs + i0 // SCALE_COLS, mask=mask_kh, other=0.0).to(tl.float32)
        scales = scales[:, :, None]
    elif (SCALE_COLS & (SCALE_COLS - 1)) == 0:
        G: tl.constexpr = STEP_COLS // SCALE_COLS
        groups = i0 // SCALE_COLS + tl.arange(0, G)
        mask = mask_kh[:, :, None] & (groups * SCALE_COLS < n_cols)[None, None, :]
        per_group = tl.load(s_ptrs[:, :, None] + groups[None, None, :], mask=mask, other=0.0)
        scales = tl.reshape(
            tl.broadcast_to(
                per_group.to(tl.float32)[:, :, :, None],
                [mask_kh.shape[0], mask_kh.shape[1], G, SCALE_COLS // 8],
            ),
            [mask_kh.shape[0], mask_kh.shape[1], STEP_COLS // 8],
        )
    else:
        mask = mask_kh[:, :, None] & (cols < n_cols)[None, None, :]
        groups = (cols // SCALE_COLS)[None, None, :]
        scales = tl.load(s_ptrs[:, :, None] + groups, mask=mask, other=0.0).to(tl.float32)
    return scales


@triton.jit
def _down_part(
    w,
    i0,
    a_rows,
    s_ptrs,
    mask_kh,
    mask_k,
    route_w,
    inter,
    STEP: tl.constexpr,
    K_PAD: tl.constexpr,
    FORMAT: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    PER_ITEM: tl.constexpr,
    EVEN: tl.constexpr,
    ACT_CACHE: tl.constexpr,
):
    """The fp32 share [K, BLOCK_H, STEP / PER_ITEM] of down words or values w [K, BLOCK_H,
    STEP / PER_ITEM] loaded from columns i0 .. i0 + STEP - 1: the slots' activations of those
    columns times the routing weight (and FP8's scale), folded in fp32 before anything is
    rounded. EVEN: no slot is padding and the step ends within the row."""
    offs = tl.arange(0, STEP // PER_ITEM)
    if FORMAT == 2:
        cols = i0 + 8 * offs
        scales = _int4_step_scales(s_ptrs, mask_kh, i0, cols, inter, STEP, SCALE_COLS)
        part = _int4_down_step(w, scales, a_rows, cols, inter, mask_k, route_w, EVEN, ACT_CACHE)
    else:
        cols = i0 + offs
        if EVEN:
            a = tl.load(a_rows + cols[None, :], cache_modifier=ACT_CACHE)
        else:
            mask_a = mask_k[:, None] & (cols < inter)[None, :]
            a = tl.load(a_rows + cols[None, :], mask=mask_a, other=0.0, cache_modifier=ACT_CACHE)
        a = a.to(tl.float32) * route_w[:, None]
        if FORMAT == 1:
            a = a * fp8_slot_column_scales(s_ptrs, i0, inter, K_PAD, STEP, SCALE_COLS)
        part = _down_tile(w, FORMAT) * a[:, None, :]
    return part


# How a down item waits for its token's activations once its first weights are loaded.
ACTS_READY = tl.constexpr(0)  # nothing to wait for (written before the launch)
ACTS_PDL = tl.constexpr(1)  # the previous kernel of the PDL chain writes them: gdc_wait
ACTS_COUNTED = tl.constexpr(2)  # written in this launch: spin until the token's items are counted


@triton.jit
def _await_count(counter_ptr, count):
    """Spin until *counter_ptr reaches `count` (acquire: what was stored before each count is
    visible after)."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    while seen < count:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")


@triton.jit
def down_item(
    act_ptr,
    w_ptr,
    s_ptr,
    ids_ptr,
    weights_ptr,
    y_ptr,
    token,
    pid_h,
    hidden,
    inter,
    top_k,
    stride_we,
    stride_wh,
    stride_se,
    stride_sh,
    stride_yt,
    ready_ptr,
    ready_count,
    K_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_I: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_H: tl.constexpr,
    EVEN_I: tl.constexpr,
    FORMAT: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    PER_ITEM: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    LINE_ELEMS: tl.constexpr,
    PRELOAD: tl.constexpr,
    EVEN_PRELOAD: tl.constexpr,
    ACTS: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    """One down work item: y[token, pid_h * BLOCK_H ..] = the sum over the token's slots of the
    routing weight times those down rows of the slot's expert @ its activations. The first
    PRELOAD columns' weights are loaded before the activations are awaited (ACTS; ACTS_COUNTED
    spins until ready_ptr[token] reaches ready_count)."""
    offs_k = tl.arange(0, K_PAD)
    mask_k = offs_k < top_k
    slots = token * top_k + offs_k
    # Padded slots repeat the last real expert: harmless for the prefetch (same lines).
    experts = tl.load(ids_ptr + token * top_k + tl.minimum(offs_k, top_k - 1)).to(tl.int64)
    route_w = tl.load(weights_ptr + slots, mask=mask_k, other=0.0).to(tl.float32)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_I // PER_ITEM)  # stored items (int4: words) of a step
    mask_h = offs_h < hidden
    if PREFETCH_LINES > 0:
        # The routing is complete before kernel 1 starts, so these rows are known now.
        lines = tl.minimum(tl.arange(0, PREFETCH_LINES), (inter - 1) // LINE_ELEMS)
        rows = tl.minimum(offs_h, hidden - 1)
        prefetch_l2(
            w_ptr
            + experts[:, None, None] * stride_we
            + rows[None, :, None] * stride_wh
            + lines[None, None, :] * LINE_ELEMS
        )
    row_ptrs = w_ptr + experts[:, None, None] * stride_we + offs_h[None, :, None] * stride_wh
    if FORMAT == 1:  # FP8: tiles never straddle two blocks' rows; scales go into the activations
        s_ptrs = s_ptr + experts * stride_se + (pid_h * BLOCK_H // SCALE_ROWS) * stride_sh
    else:  # int4: a scale per slot, row and group
        s_ptrs = s_ptr + experts[:, None] * stride_se + offs_h[None, :] * stride_sh
    mask_kh = mask_k[:, None] & mask_h[None, :]
    a_rows = act_ptr + slots[:, None] * inter
    if PRELOAD > 0:  # the first PRELOAD columns of down rows need only the routing: load them now
        offs_p = tl.arange(0, PRELOAD // PER_ITEM)
        mask_p = mask_kh[:, :, None] & (offs_p * PER_ITEM < inter)[None, None, :]
        w_pre = tl.load(row_ptrs + offs_p[None, None, :], mask=mask_p, other=0)
    if ACTS == ACTS_PDL:  # kernel 1's activations are visible after this
        tl.extra.cuda.gdc_wait()
    if ACTS == ACTS_COUNTED:  # other programs of this launch are writing them
        _await_count(ready_ptr + token, ready_count)
    # The acquire in _await_count orders these reads after the writers' release, so plain
    # loads would be correct too; .cg skips L1, which other SMs' lines never reach anyway.
    ACT_CACHE: tl.constexpr = ".cg" if ACTS == ACTS_COUNTED else ""
    # int4: a column per word, the sum over its eight values being formed in the step.
    acc = tl.zeros([K_PAD, BLOCK_H, BLOCK_I // PER_ITEM], dtype=tl.float32)
    acc_preload = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float32)
    if PRELOAD > 0:
        part = _down_part(
            w_pre, 0, a_rows, s_ptrs, mask_kh, mask_k, route_w, inter,
            PRELOAD, K_PAD, FORMAT, SCALE_COLS, PER_ITEM, EVEN_K and EVEN_PRELOAD, ACT_CACHE,
        )  # fmt: skip
        if PRELOAD == BLOCK_I:  # the loop's shape: summed in the same order as a loop step
            acc += part
        else:
            acc_preload += tl.sum(part, axis=2)
    w_ptrs = row_ptrs + (PRELOAD // PER_ITEM + offs_c)[None, None, :]  # the loop's first step
    for i0 in tl.range(PRELOAD, inter, BLOCK_I, num_stages=LOOP_STAGES):
        if EVEN_K and EVEN_H and EVEN_I:
            w = tl.load(w_ptrs)
        else:
            mask_w = mask_kh[:, :, None] & ((i0 + offs_c * PER_ITEM) < inter)[None, None, :]
            w = tl.load(w_ptrs, mask=mask_w, other=0)
        acc += _down_part(
            w, i0, a_rows, s_ptrs, mask_kh, mask_k, route_w, inter,
            BLOCK_I, K_PAD, FORMAT, SCALE_COLS, PER_ITEM, EVEN_K and EVEN_I, ACT_CACHE,
        )  # fmt: skip
        w_ptrs += BLOCK_I // PER_ITEM

    y = tl.sum(tl.sum(acc, axis=2) + acc_preload, axis=0)
    tl.store(y_ptr + token * stride_yt + offs_h, y.to(y_ptr.dtype.element_ty), mask=mask_h)
