"""One Qwen3-MoE decoder layer: its weights as the kernels read them (`LayerWeights`) and its
computation in torch (`decoder_layer`), the general path that prefill and decode, CPU or CUDA
eager, all run. Numerics follow transformers' Qwen3-MoE.

The other backends compute the same layer over the same `LayerWeights`: the lean CPU forward of
a few rows (engine.model.lean_cpu) and the CUDA-graph decode step (engine.model.cuda_graph),
which shares `mlp` with this one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.kv.cache import ModelCache
from engine.model.config import ModelConfig
from engine.model.options import ModelOptions
from kernels import dispatch
from kernels import reference as ref
from kernels.quant import Weight, dequantize
from kernels.quant_linear import linear

# On the CPU, reading each routed expert in place (output-centric) wins while few tokens are
# routed; past this many (token, expert) pairs (the measured crossover) the grouped path, which
# reads each expert once for all its tokens, is faster.
CPU_OUTPUT_CENTRIC_MAX_PAIRS = 4


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    post_attention_norm: torch.Tensor  # [H]
    # The projections are tensors in the model's dtype or, on CUDA, quantized as the checkpoint
    # stored them (kernels.quant); norms and router are always tensors.
    w_qkv: Weight  # [(Hq + 2*Hkv) * D, H]: q, k, v projections fused at load time
    b_qkv: torch.Tensor | None
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    w_o: Weight  # [H, Hq * D]
    b_o: torch.Tensor | None
    w_gate_up: Weight  # MoE: [E, 2I, H] (gate rows first); dense: [2I, H]
    w_down: Weight  # MoE: [E, H, I]; dense: [H, I]
    router: torch.Tensor | None  # [E, H] on MoE layers, None on dense layers


def decoder_layer(
    x: torch.Tensor,
    layer: LayerWeights,
    index: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: ModelCache,
    cfg: ModelConfig,
    options: ModelOptions,
) -> torch.Tensor:
    """The residual stream x [B, T, H] after layer `index`; cos, sin [B, 1, T, D] (RoPE at
    positions [B, T]). This layer's K/V go into `cache`."""
    batch, n_tokens, _ = x.shape
    h = ref.rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
    x = x + attention(h, layer, index, positions, cos, sin, cache, cfg)
    h = ref.rms_norm(x, layer.post_attention_norm, cfg.rms_norm_eps)
    return x + mlp(h.reshape(batch * n_tokens, -1), layer, cfg, options).reshape(
        batch, n_tokens, -1
    )


def attention(h, layer: LayerWeights, index, positions, cos, sin, cache: ModelCache, cfg):
    """Self-attention of normed h [B, T, H]: q/k/v, per-head q/k RMSNorm, RoPE, the cache's
    causal attention, the output projection."""
    batch, n_tokens, _ = h.shape
    d = cfg.head_dim
    qkv = linear(h, layer.w_qkv, layer.b_qkv)
    q, k, v = qkv.split([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], dim=-1)
    q = ref.rms_norm(q.view(batch, n_tokens, cfg.num_heads, d), layer.q_norm, cfg.rms_norm_eps)
    k = ref.rms_norm(k.view(batch, n_tokens, cfg.num_kv_heads, d), layer.k_norm, cfg.rms_norm_eps)
    q = ref.apply_rope(q.transpose(1, 2), cos, sin)
    k = ref.apply_rope(k.transpose(1, 2), cos, sin)
    v = v.view(batch, n_tokens, cfg.num_kv_heads, d).transpose(1, 2)
    out = cache.attend(index, positions, q, k, v, cfg.sliding_window)
    return linear(out.transpose(1, 2).reshape(batch, n_tokens, -1), layer.w_o, layer.b_o)


def mlp(
    x: torch.Tensor,
    layer: LayerWeights,
    cfg: ModelConfig,
    options: ModelOptions,
    routing: tuple[torch.Tensor, torch.Tensor] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """The layer's dense MLP or MoE (router, then the chosen path) on normed x [N, H].

    `routing` (topk_ids, topk_weights): the router already ran (the decode step fuses it with
    the norm). `pdl`: x comes from a PDL chain of Triton kernels (kernels.pdl) that warp decode
    joins."""
    if layer.router is None:
        return ref.dense_mlp(x, layer.w_gate_up, layer.w_down, linear)
    if routing is None:
        route = dispatch.route if x.is_cuda else ref.route  # fused Triton router on CUDA
        routing = route(x, layer.router, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    topk_ids, topk_weights = routing
    moe = options.moe_fn
    if moe is None:
        moe = moe_path(options.moe_path, x.shape[0] * cfg.num_experts_per_tok, x)
        if pdl and moe is dispatch.moe:
            moe = functools.partial(dispatch.moe, pdl=True)
    w_gate_up, w_down = layer.w_gate_up, layer.w_down
    if not x.is_cuda:  # the CPU's torch paths multiply plain tensors
        w_gate_up, w_down = dequantize(w_gate_up, x.dtype), dequantize(w_down, x.dtype)
    return moe(x, w_gate_up, w_down, topk_ids, topk_weights)


def moe_path(forced: str, pairs: int, x: torch.Tensor):
    """The MoE function for `pairs` routed (token, expert) pairs of x: the forced path's torch
    reference, else on CUDA the Triton dispatcher (warp decode or expert-centric, by a measured
    crossover) and on the CPU the reference path that suits the pair count."""
    if forced == "expert_centric":
        return ref.moe_expert_centric
    if forced == "output_centric":
        return ref.moe_output_centric
    if x.device.type == "cuda":
        return dispatch.moe
    if pairs <= CPU_OUTPUT_CENTRIC_MAX_PAIRS:
        return ref.moe_output_centric
    return ref.moe_expert_centric
