"""Causal attention of a prompt chunk on CUDA, over the keys gathered from the paged pool.

A chunk of one sequence (its queries at the positions just before the keys' end, in order) runs
as flash attention with the causal mask aligned to the keys' end (`causal_lower_right`) and the
query heads grouped over the key heads (`enable_gqa`): no mask is built, no key is copied once
per query head, and tiles above the diagonal are skipped. Anything else (several sequences, a
sliding window, a GPU or dtype that flash attention does not take) runs SDPA with an explicit
mask over keys widened to every query head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kernels import reference as ref


def is_one_run(positions: torch.Tensor, kv_len: int) -> bool:
    """Whether positions [B, T] are one sequence's kv_len - T, ..., kv_len - 1, in order: a
    prompt chunk after everything before it (one device sync)."""
    batch, n = positions.shape
    if batch != 1:
        return False
    want = torch.arange(kv_len - n, kv_len, device=positions.device)
    return bool(torch.equal(positions[0], want))


def flash_applies(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether this GPU's flash attention takes these tensors with grouped query heads."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return q.is_cuda and can_use_flash_attention(
        SDPAParams(q, keys, values, None, 0.0, False, True), False
    )


def chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [1, Hq, T, D] at the last T of the S positions of keys, values [1, Hkv, S, D]:
    causal attention, query head h reading key head h // (Hq / Hkv)."""
    mask = causal_lower_right(q.shape[2], keys.shape[2])
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


def masked_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    sliding_window: int | None,
) -> torch.Tensor:
    """q [B, Hq, T, D] at positions [B, T] over keys, values [B, Hkv, S, D]: SDPA with an
    explicit mask, keys and values repeated for every query head of their group."""
    allowed = ref.causal_mask(positions, keys.shape[2], sliding_window)[:, None]  # [B, 1, T, S]
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)
