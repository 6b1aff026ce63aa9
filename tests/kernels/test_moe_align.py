"""The expert grouping of the expert-centric MoE: the one-program Triton kernel (decode sizes)
and the torch ops used for prefill sizes give the same grouping."""

import pytest
import torch

from kernels.moe_align import align_by_expert, align_by_expert_torch


@pytest.mark.parametrize(
    "tokens,k,experts,block_m", [(3, 2, 8, 4), (37, 2, 8, 16), (50, 4, 16, 8), (9, 8, 128, 16)]
)
def test_torch_grouping_matches_the_kernel(tokens, k, experts, block_m):
    g = torch.Generator().manual_seed(tokens * k)
    ids = torch.stack(
        [torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]
    )  # distinct per token
    fast_slots, fast_blocks, fast_used = align_by_expert_torch(ids, experts, block_m)
    slots, blocks, used = align_by_expert(ids, experts, block_m)
    assert torch.equal(fast_used, used)
    assert torch.equal(fast_blocks, blocks)
    assert torch.equal(fast_slots, slots)
    # Every slot appears once, in its expert's block, in original order within the expert.
    real = fast_slots[fast_slots < ids.numel()].long()
    assert sorted(real.tolist()) == list(range(ids.numel()))
    flat = ids.reshape(-1)
    for row, slot in enumerate(fast_slots.tolist()):
        if slot < ids.numel():
            assert flat[slot].item() == fast_blocks[row // block_m].item()
