"""Next-token choice: greedy, or temperature with nucleus (top-p) filtering, seeded; and the one
rule every generation path applies to a request's next token (`TokenChooser`)."""

from __future__ import annotations

import functools

import torch

from engine.decoding.token_healing import Forcing

# Below this a temperature is greedy for all practical purposes, and dividing by it overflows.
GREEDY_BELOW = 1e-5


def forbid(logits: torch.Tensor, token_ids: tuple[int, ...]) -> torch.Tensor:
    """logits [..., V] with `token_ids` made impossible to sample (a new tensor)."""
    if not token_ids:
        return logits
    return logits.index_fill(-1, _index(token_ids, logits.device), float("-inf"))


@functools.lru_cache(maxsize=16)
def _index(token_ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Made once: a copy to the GPU per step would stall.
    return torch.tensor(token_ids, device=device)


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


class TokenChooser:
    """A request's next token: ids past the tokenizer's vocabulary (a checkpoint's padded
    embedding rows) and the ones it never samples are impossible, the healed text's constraint
    holds while it is active, and a greedy id already taken on the device (CUDA graphs) is used
    only where none of that could change it."""

    def __init__(self, unsampled_ids: tuple[int, ...], vocab_limit: int | None):
        self.unsampled_ids = tuple(unsampled_ids)
        self.vocab_limit = vocab_limit

    def visible(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] without the padded ids."""
        return logits[..., : self.vocab_limit] if self.vocab_limit is not None else logits

    def constrain(self, logits: torch.Tensor, forcing: Forcing | None = None) -> torch.Tensor:
        """logits [..., V] with every id the request may not write next made impossible: past
        the vocabulary (cut off), never sampled, or breaking the healed text while `forcing` is
        active."""
        logits = forbid(self.visible(logits), self.unsampled_ids)
        if forcing is not None and forcing.active:
            logits = forcing.mask(logits)
        return logits

    def choose(
        self,
        logits: torch.Tensor,
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        forcing: Forcing | None = None,
        device_greedy: int | torch.Tensor | None = None,
    ) -> int:
        """The token for logits [V]; advances `forcing` by it."""
        forced = forcing is not None and forcing.active
        # The device's argmax knows neither the forbidden ids nor the constraint.
        if forced or (device_greedy is not None and int(device_greedy) in self.unsampled_ids):
            device_greedy = None
        if device_greedy is not None and temperature < GREEDY_BELOW:
            token = int(device_greedy)
        else:
            logits = self.constrain(logits, forcing)
            token = int(sample(logits[None], temperature, top_p, generator))
        if forced:
            forcing.advance(token)
        return token
