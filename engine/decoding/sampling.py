"""Next-token choice: greedy, or temperature with nucleus (top-p) filtering, seeded."""

from __future__ import annotations

import functools

import torch

# Below this a temperature is greedy for all practical purposes, and dividing by it overflows.
GREEDY_BELOW = 1e-5


def forbid(logits: torch.Tensor, token_ids: tuple[int, ...]) -> torch.Tensor:
    """logits [..., V] with `token_ids` made impossible to sample (a new tensor)."""
    if not token_ids:
        return logits
    return logits.index_fill(-1, _index(token_ids, logits.device), float("-inf"))


@functools.lru_cache(maxsize=16)
def _index(token_ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(
        token_ids, device=device
    )  # made once: a copy to the GPU per step would stall


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [B, V] -> token ids [B]. temperature 0 is greedy (ties go to the lowest id)."""
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest set whose mass reaches top_p; the first token always survives.
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
