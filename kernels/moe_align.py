"""Group the (token, slot) pairs of a routing by expert, padded to the GEMM's row block.

The expert-centric path needs, for every row block of its grouped GEMMs, one expert and up to
BLOCK_M slot indices (slot = token * k + j) routed to it. One launch of one program does it all:

    sorted_slots [max_rows]   slot indices grouped by expert, each group padded with `numel`
                              (an out-of-range slot the GEMMs mask off) to a multiple of BLOCK_M
    block_expert [max_blocks] the expert of each row block, -1 past the used blocks
    rows_used    [1]          rows actually used (a multiple of BLOCK_M)

Sizes are bounded on the host (no sync), so the whole layer can be captured in a CUDA graph:
max_rows = numel + min(numel, E) * (BLOCK_M - 1), rounded up to BLOCK_M.
Within an expert the slots stay in their original order (a stable sort).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_env import next_pow2


@triton.jit(do_not_specialize=["numel", "max_rows"])
def _align_kernel(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    rows_used_ptr,
    numel,
    max_rows,
    n_experts,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    experts = tl.arange(0, E_PAD)
    offs = tl.arange(0, CHUNK)

    # Pass 1: per-expert counts, padded to BLOCK_M, and each group's first row.
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, numel, CHUNK):
        ids = tl.load(ids_ptr + c0 + offs, mask=c0 + offs < numel, other=E_PAD).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    rows_used = tl.sum(padded, axis=0)
    tl.store(rows_used_ptr, rows_used)

    # The expert of each row block: the number of groups that end at or before its first row.
    for r0 in range(0, max_rows, CHUNK * BLOCK_M):
        blocks = r0 // BLOCK_M + offs
        first_row = blocks * BLOCK_M
        owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        owner = tl.where(first_row < rows_used, owner, -1)
        tl.store(block_expert_ptr + blocks, owner, mask=first_row < max_rows)

    # Padding rows first; the scatter below overwrites the real ones.
    for r0 in range(0, max_rows, CHUNK):
        tl.store(
            sorted_ptr + r0 + offs,
            numel + tl.zeros([CHUNK], dtype=tl.int32),
            mask=r0 + offs < max_rows,
        )
    tl.debug_barrier()  # order the two stores to the same rows across the program's threads

    # Pass 2: stable scatter; a slot's row = group start + earlier slots of its expert.
    next_row = starts
    for c0 in range(0, numel, CHUNK):
        valid = c0 + offs < numel
        ids = tl.load(ids_ptr + c0 + offs, mask=valid, other=E_PAD).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - onehot
        row = tl.sum(onehot * (rank + next_row[None, :]), axis=1)
        tl.store(sorted_ptr + row, (c0 + offs).to(tl.int32), mask=valid)
        next_row += tl.sum(onehot, axis=0)


def max_rows(numel: int, n_experts: int, block_m: int) -> int:
    rows = numel + min(numel, n_experts) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


# Past this many (token, slot) pairs the one-program kernel's serial loop is the bottleneck
# (it takes longer than the expert GEMM it prepares); a few parallel torch ops (a stable sort, a
# scatter-add, a search) do the same grouping.
ONE_PROGRAM_MAX_PAIRS = 2048


def align_by_expert(topk_ids: torch.Tensor, n_experts: int, block_m: int):
    """(sorted_slots int32, block_expert int32, rows_used int32[1]) for the grouped GEMMs."""
    numel = topk_ids.numel()
    if numel > ONE_PROGRAM_MAX_PAIRS:
        return align_by_expert_torch(topk_ids, n_experts, block_m)
    rows = max_rows(numel, n_experts, block_m)
    device = topk_ids.device
    sorted_slots = torch.empty(rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=device)
    rows_used = torch.empty(1, dtype=torch.int32, device=device)
    e_pad = next_pow2(n_experts)
    # The one-hot tile is CHUNK x E_PAD ints: keep it near 8K elements.
    chunk = max(16, min(128, 8192 // e_pad, next_pow2(numel)))
    _align_kernel[(1,)](
        topk_ids.reshape(-1),
        sorted_slots,
        block_expert,
        rows_used,
        numel,
        rows,
        n_experts,
        BLOCK_M=block_m,
        E_PAD=e_pad,
        CHUNK=chunk,
        num_warps=4,
    )
    return sorted_slots, block_expert, rows_used


def align_by_expert_torch(topk_ids: torch.Tensor, n_experts: int, block_m: int):
    """`align_by_expert` from parallel torch ops (no host sync: capturable too), same output."""
    ids = topk_ids.reshape(-1).long()
    numel = ids.numel()
    rows = max_rows(numel, n_experts, block_m)
    device = ids.device
    counts = torch.zeros(n_experts, dtype=torch.long, device=device).scatter_add_(
        0, ids, torch.ones_like(ids)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.sort(ids, stable=True).indices  # slots grouped by expert, in order within one
    grouped = ids[order]
    first_of_group = counts.cumsum(0) - counts  # index in `order` of each expert's first slot
    row = starts[grouped] + torch.arange(numel, device=device) - first_of_group[grouped]
    sorted_slots = torch.full((rows,), numel, dtype=torch.int32, device=device)
    sorted_slots[row] = order.to(torch.int32)
    rows_used = ends[-1:].to(torch.int32)
    first_row = torch.arange(0, rows, block_m, device=device)
    owner = torch.searchsorted(ends, first_row, right=True).to(torch.int32)
    block_expert = torch.where(first_row < rows_used, owner, torch.full_like(owner, -1))
    return sorted_slots, block_expert, rows_used
