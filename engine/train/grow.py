"""Grow a trained MoE's experts wider without changing what it computes, so training goes on
from its weights with more capacity instead of starting over.

Each expert's intermediate size grows from I to I': the new gate/up rows start random, the new
down_proj columns start at zero, so the new units add nothing until training moves them (as a
LoRA adapter starts). Top-k and the router are untouched: the model routes exactly as before.
Wider experts rather than more experts, because at top-k 2 copied experts cannot keep the
model's function (a token would get its best expert twice instead of its best two).
"""
from __future__ import annotations

import re

import torch

_GATE_UP = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up)_proj\.weight$")
_DOWN = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.down_proj\.weight$")


def expert_width(weights: dict[str, torch.Tensor]) -> int:
    """moe_intermediate_size of a checkpoint with the per-expert HF layout (0: no experts)."""
    return next((t.shape[0] for k, t in weights.items() if _GATE_UP.match(k)), 0)


def widen_experts(weights: dict[str, torch.Tensor], width: int, std: float = 0.02,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    old = expert_width(weights)
    if width < old:
        raise ValueError(f"cannot narrow experts from {old} to {width}")
    g = torch.Generator().manual_seed(seed)
    grown: dict[str, torch.Tensor] = {}
    for key, t in weights.items():
        if _GATE_UP.match(key):
            new_rows = torch.randn(width - old, t.shape[1], generator=g) * std
            grown[key] = torch.cat([t, new_rows.to(t.dtype)])
        elif _DOWN.match(key):
            grown[key] = torch.cat([t, t.new_zeros(t.shape[0], width - old)], dim=1)
        else:
            grown[key] = t
    return grown
