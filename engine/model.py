"""Qwen3-MoE forward pass over weights laid out for the kernels.

One `forward` serves prefill (many tokens) and decode (one token per sequence); the MoE layer
picks its path from the number of routed tokens. Numerics follow transformers' Qwen3-MoE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.kv_cache import KVCache
from kernels import dispatch
from kernels import reference as ref

MOE_PATHS = ("auto", "expert_centric", "output_centric")
# On the CPU, reading each routed expert in place (output-centric) wins while few tokens are
# routed; past this many (token, expert) pairs (measured crossover 4-8) the grouped path, which
# reads each expert once for all its tokens, is faster.
CPU_OUTPUT_CENTRIC_MAX_PAIRS = 4


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    post_attention_norm: torch.Tensor  # [H]
    w_qkv: torch.Tensor  # [(Hq + 2*Hkv) * D, H]: q, k, v projections fused at load time
    b_qkv: torch.Tensor | None
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    w_o: torch.Tensor  # [H, Hq * D]
    b_o: torch.Tensor | None
    w_gate_up: torch.Tensor  # MoE: [E, 2I, H] (gate rows first); dense: [2I, H]
    w_down: torch.Tensor  # MoE: [E, H, I]; dense: [H, I]
    router: torch.Tensor | None  # [E, H] on MoE layers, None on dense layers


class Qwen3MoeModel:
    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
    ):
        self.config = config
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.dtype = embed.dtype
        self.device = embed.device
        self.moe_path = "auto"
        # Replaces the MoE path when set (same arguments as `kernels.reference.moe_*`); expert
        # parallelism (`engine.parallel`) sets it, since its layers hold only the local experts.
        self.moe_fn = None
        self.inv_freq = ref.rope_inv_freq(config.head_dim, config.rope_theta).to(self.device)

    def new_cache(self, batch: int, capacity: int = 256) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, capacity, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        last_only: bool = False,
    ) -> torch.Tensor:
        """tokens, positions [B, T] -> logits [B, T, V] (or [B, 1, V] with last_only), fp32.

        K/V of these tokens are written into `cache` at their positions; each query attends to
        every cached key at or before its own position.
        """
        cfg = self.config
        batch, n_tokens = tokens.shape
        cache.reserve(int(positions.max()) + 1)
        x = F.embedding(tokens, self.embed)
        cos, sin = ref.rope_cos_sin(positions, self.inv_freq, self.dtype)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        for index, layer in enumerate(self.layers):
            h = ref.rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            x = x + self._attention(h, layer, index, positions, cos, sin, cache)
            h = ref.rms_norm(x, layer.post_attention_norm, cfg.rms_norm_eps)
            x = x + self.mlp(h.reshape(batch * n_tokens, -1), layer).reshape(batch, n_tokens, -1)
        if last_only:
            x = x[:, -1:]
        x = ref.rms_norm(x, self.final_norm, cfg.rms_norm_eps)
        return F.linear(x, self.lm_head).float()

    def _attention(self, h, layer: LayerWeights, index, positions, cos, sin, cache: KVCache):
        cfg = self.config
        batch, n_tokens, _ = h.shape
        d = cfg.head_dim
        qkv = F.linear(h, layer.w_qkv, layer.b_qkv)
        q, k, v = qkv.split([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], dim=-1)
        q = ref.rms_norm(q.view(batch, n_tokens, cfg.num_heads, d), layer.q_norm, cfg.rms_norm_eps)
        k = ref.rms_norm(k.view(batch, n_tokens, cfg.num_kv_heads, d), layer.k_norm, cfg.rms_norm_eps)
        q = ref.apply_rope(q.transpose(1, 2), cos, sin)
        k = ref.apply_rope(k.transpose(1, 2), cos, sin)
        v = v.view(batch, n_tokens, cfg.num_kv_heads, d).transpose(1, 2)
        out = cache.attend(index, positions, q, k, v, cfg.sliding_window)
        return F.linear(out.transpose(1, 2).reshape(batch, n_tokens, -1), layer.w_o, layer.b_o)

    def mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """The layer's dense MLP or MoE (router, then the chosen path) on x [N, H]."""
        if layer.router is None:
            return ref.dense_mlp(x, layer.w_gate_up, layer.w_down)
        cfg = self.config
        route = dispatch.route if x.is_cuda else ref.route  # fused Triton router on CUDA
        topk_ids, topk_weights = route(x, layer.router, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        if self.moe_fn is not None:
            return self.moe_fn(x, layer.w_gate_up, layer.w_down, topk_ids, topk_weights)
        return self._moe_fn(x.shape[0] * cfg.num_experts_per_tok, x.device)(
            x, layer.w_gate_up, layer.w_down, topk_ids, topk_weights
        )

    def _moe_fn(self, pairs: int, device: torch.device):
        if self.moe_path == "expert_centric":
            return ref.moe_expert_centric
        if self.moe_path == "output_centric":
            return ref.moe_output_centric
        if device.type == "cuda":
            return dispatch.moe  # Triton: warp decode or expert-centric, by a measured crossover
        return ref.moe_output_centric if pairs <= CPU_OUTPUT_CENTRIC_MAX_PAIRS else ref.moe_expert_centric
