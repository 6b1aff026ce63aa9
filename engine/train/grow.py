"""Grow a trained MoE, so training goes on from its weights with more capacity instead of
starting over. Two ways:

- Wider experts (`widen_experts`): each expert's intermediate size grows from I to I'. The new
  gate/up rows start random, the new down_proj columns at zero, so the new units add nothing
  until training moves them (as a LoRA adapter starts): the same function, exactly. Costs
  arithmetic per token.
- More experts (`add_experts`): the new experts start as copies of each layer's busiest ones,
  with router rows near zero. Costs no arithmetic per token at the same top-k. A copy with its
  original's router row would be picked together with it (a token would get its best expert
  twice instead of its best two); a near-zero row gives logits near 0, which win a top-k slot
  only where a token's k-th best logit is negative (a small share of tokens), and there the copy
  computes what a busy expert computes, so the held-out loss barely moves at step 0; the balance
  loss then pulls tokens towards the new experts.
"""

from __future__ import annotations

import re

import torch

_GATE_UP = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up)_proj\.weight$")
_DOWN = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.down_proj\.weight$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.weight$")


def expert_width(weights: dict[str, torch.Tensor]) -> int:
    """moe_intermediate_size of a checkpoint with the per-expert HF layout (0: no experts)."""
    return next((t.shape[0] for k, t in weights.items() if _GATE_UP.match(k)), 0)


def widen_experts(
    weights: dict[str, torch.Tensor], width: int, std: float = 0.02, seed: int = 0
) -> dict[str, torch.Tensor]:
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


def expert_count(weights: dict[str, torch.Tensor]) -> int:
    """num_experts of a checkpoint (the router's rows; 0: no experts)."""
    return next((t.shape[0] for k, t in weights.items() if _ROUTER.match(k)), 0)


@torch.no_grad()
def router_loads(model: torch.nn.Module, rows: torch.Tensor, batch: int = 4) -> torch.Tensor:
    """[layers, experts]: how many top-k slots each expert of each layer takes on these token rows
    (a Qwen3MoeLM from engine/train/model.py)."""
    layers = model.model.layers
    counts = torch.zeros(len(layers), layers[0].mlp.n_experts, dtype=torch.int64)

    def counter(i: int, top_k: int):
        def hook(gate, inputs, logits):
            top = logits.float().topk(top_k, dim=-1).indices.flatten().cpu()
            counts[i] += torch.bincount(top, minlength=counts.shape[1])

        return hook

    hooks = [
        layer.mlp.gate.register_forward_hook(counter(i, layer.mlp.top_k))
        for i, layer in enumerate(layers)
    ]
    try:
        device = next(model.parameters()).device
        for i in range(0, len(rows), batch):
            model(rows[i : i + batch].to(device))
    finally:
        for h in hooks:
            h.remove()
    return counts


def copy_sources(loads: torch.Tensor, added: int) -> list[list[int]]:
    """Per layer, the expert each of `added` new ones copies: the busiest by `loads` [layers, E]
    first, going round again if more are added than there are."""
    busiest = loads.argsort(dim=1, descending=True, stable=True).tolist()
    return [[order[j % len(order)] for j in range(added)] for order in busiest]


def add_experts(
    weights: dict[str, torch.Tensor],
    total: int,
    loads: torch.Tensor,
    router_std: float = 1e-3,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Grow every layer to `total` experts: the new ones copy the experts `copy_sources` names and
    get router rows drawn at `router_std`, small enough that their logits sit near 0 (see the
    module's notes)."""
    old = expert_count(weights)
    if total < old:
        raise ValueError(f"cannot drop experts: {old} to {total}")
    sources = copy_sources(loads, total - old)
    g = torch.Generator().manual_seed(seed)
    grown = dict(weights)
    for key, router in weights.items():
        if not (m := _ROUTER.match(key)):
            continue
        layer = int(m.group(1))
        new_rows = torch.randn(total - old, router.shape[1], generator=g) * router_std
        grown[key] = torch.cat([router, new_rows.to(router.dtype)])
        prefix = f"model.layers.{layer}.mlp.experts"
        for j, source in enumerate(sources[layer]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                grown[f"{prefix}.{old + j}.{proj}.weight"] = weights[
                    f"{prefix}.{source}.{proj}.weight"
                ].clone()
    return grown
