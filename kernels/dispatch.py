"""The engine's entry points for a MoE layer: pick the path, run it.

CUDA tensors go to Triton: warp decode (output-centric), its deduplicated variant (an expert's
gate/up rows read once per batch), its batched variant (every token in each program) or the
expert-centric fused MoE, whichever the crossover table in `kernels/configs/crossover.json`
measured faster at this (tokens, k, E); CPU tensors go to the torch references. The table is
written by `python -m kernels.bench.moe --tune` on the GPU.
"""

from __future__ import annotations

import torch

from kernels import reference, tuned
from kernels.quant import Weight, dequantize, format_name

WARP_DECODE = "warp_decode"
WARP_DECODE_DEDUP = "warp_decode_dedup"  # output-centric, gate/up rows once per expert
WARP_DECODE_BATCHED = "warp_decode_batched"  # output-centric, every token in each program
EXPERT_CENTRIC = "expert_centric"
# The kernels' own limits, kept here so choosing a path needs no Triton import:
BATCHED_MAX_TOKENS = 64  # kernels.warp_decode_batched.MAX_TOKENS
DEDUP_MAX_SLOTS = 1024  # kernels.warp_decode_dedup.MAX_SLOTS

# Without a measurement for this (E, k): warp decode while the routed slots (tokens * k) are at
# most this many times E. Its weight traffic grows with the slots, the expert-centric path's
# with the distinct experts touched.
DEFAULT_SLOTS_PER_EXPERT = 0.5


def _table() -> dict:
    return tuned.load("crossover.json") or {}


# The paths that read quantized weights (kernels.quant) as stored.
QUANTIZED_PATHS = (WARP_DECODE, EXPERT_CENTRIC)


def choose_path(tokens: int, top_k: int, experts: int, weights: str = "bf16") -> str:
    """The path (WARP_DECODE, WARP_DECODE_DEDUP, ...) for a CUDA MoE layer of this size whose
    weights are in format `weights` (kernels.quant.format_name): quantized weights take the
    crossover measured for their format, between the paths that read them."""
    key = f"E{experts}_k{top_k}" if weights == "bf16" else f"E{experts}_k{top_k}_{weights}"
    entry = _table().get(key)
    if entry is not None and entry.get("winners"):
        path = tuned.nearest(entry["winners"], tokens)
        if path == WARP_DECODE_BATCHED and tokens > BATCHED_MAX_TOKENS:
            return EXPERT_CENTRIC
        if path == WARP_DECODE_DEDUP and tokens * top_k > DEDUP_MAX_SLOTS:
            return EXPERT_CENTRIC
        if weights != "bf16" and path not in QUANTIZED_PATHS:
            return (
                WARP_DECODE if path in (WARP_DECODE_BATCHED, WARP_DECODE_DEDUP) else EXPERT_CENTRIC
            )
        return path
    ratio = DEFAULT_SLOTS_PER_EXPERT
    measured = [
        e
        for e in _table().values()
        if "slots_per_expert" in e and e.get("weights", "bf16") == weights
    ]
    if measured:  # the nearest measured E decides the ratio
        ratio = min(measured, key=lambda e: abs(e["experts"] - experts))["slots_per_expert"]
    return WARP_DECODE if tokens * top_k <= ratio * experts else EXPERT_CENTRIC


def moe(
    x: torch.Tensor,
    w_gate_up: Weight,
    w_down: Weight,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    pdl: bool = False,
) -> torch.Tensor:
    """MoE layer output y [T, H] in x's dtype.

    x [T, H]; w_gate_up [E, 2I, H] gate rows first; w_down [E, H, I] (tensors, or on CUDA
    quantized weights, kernels.quant); topk_ids [T, k] int; topk_weights [T, k] fp32 (as
    returned by `route`). `pdl`: the decode step's kernels form a PDL chain (kernels.pdl), which
    warp decode joins; the other paths launch as usual.
    """
    tokens, top_k = topk_ids.shape
    experts = w_gate_up.shape[0]
    if x.is_cuda:
        path = choose_path(tokens, top_k, experts, format_name(w_down))
        return run_path(path, x, w_gate_up, w_down, topk_ids, topk_weights, pdl)
    w_gate_up, w_down = dequantize(w_gate_up, x.dtype), dequantize(w_down, x.dtype)
    # CPU: the output-centric reference reads T*k experts' weights, fine for a few tokens;
    # past one slot per expert, grouping by expert reads less.
    if tokens * top_k <= experts:
        return reference.moe_output_centric(x, w_gate_up, w_down, topk_ids, topk_weights)
    return reference.moe_expert_centric(x, w_gate_up, w_down, topk_ids, topk_weights)


def run_path(
    path: str, x, w_gate_up, w_down, topk_ids, topk_weights, pdl: bool = False
) -> torch.Tensor:
    """Run one Triton path by name (the kernels import Triton, so they load on first use)."""
    if path == WARP_DECODE:
        from kernels.warp_decode import warp_decode_moe

        return warp_decode_moe(x, w_gate_up, w_down, topk_ids, topk_weights, pdl=pdl)
    if path == WARP_DECODE_DEDUP:
        from kernels.warp_decode_dedup import warp_decode_dedup_moe

        return warp_decode_dedup_moe(x, w_gate_up, w_down, topk_ids, topk_weights)
    if path == WARP_DECODE_BATCHED:
        from kernels.warp_decode_batched import warp_decode_batched_moe

        return warp_decode_batched_moe(x, w_gate_up, w_down, topk_ids, topk_weights)
    if path == EXPERT_CENTRIC:
        from kernels.fused_moe import fused_moe

        return fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights)
    raise ValueError(f"unknown MoE path {path!r}")


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """Router: (topk_ids int64 [T, k], topk_weights fp32 [T, k]), softmax -> top-k -> renorm."""
    if x.is_cuda:
        from kernels.router import route as triton_route

        return triton_route(x, router_weight, top_k, norm_topk_prob)
    return reference.route(x, router_weight, top_k, norm_topk_prob)
