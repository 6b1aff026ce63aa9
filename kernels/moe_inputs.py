"""The argument checks and layout every Triton MoE path starts with."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.quant import Weight, is_quantized


class MoeInputs(NamedTuple):
    x: torch.Tensor  # [T, H], last dim contiguous
    w_gate_up: Weight  # [E, 2I, H]
    w_down: Weight  # [E, H, I]
    ids: torch.Tensor  # [T, k] contiguous
    route_w: torch.Tensor  # [T, k] fp32 contiguous
    tokens: int
    hidden: int
    inter: int
    experts: int
    top_k: int


def moe_inputs(x, w_gate_up, w_down, topk_ids, topk_weights) -> MoeInputs:
    """Shapes checked, tensors made contiguous along their last dim (copies only if needed);
    quantized weights (kernels.quant) pass as they are."""
    tokens, hidden = x.shape
    experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    assert tuple(w_down.shape) == (experts, hidden, inter), "w_down must be [E, H, I]"
    assert topk_ids.shape == topk_weights.shape == (tokens, top_k)

    def last_dim_contiguous(t):
        return t if is_quantized(t) or t.stride(-1) == 1 else t.contiguous()

    return MoeInputs(
        last_dim_contiguous(x),
        last_dim_contiguous(w_gate_up),
        last_dim_contiguous(w_down),
        topk_ids.contiguous(),
        topk_weights.to(torch.float32).contiguous(),
        tokens,
        hidden,
        inter,
        experts,
        top_k,
    )
