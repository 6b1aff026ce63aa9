"""Qwen3-MoE forward pass over weights laid out for the kernels.

One `forward` serves prefill (many tokens) and decode (one token per sequence); the MoE layer
picks its path from the number of routed tokens. Numerics follow transformers' Qwen3-MoE.
On the CPU, one sequence's decode step in fp32 takes a leaner path (`_forward_lone`): the same
arithmetic in fewer ops, since there a step's cost is mostly the fixed cost of each small op.
"""

from __future__ import annotations

import math
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
        self.lone_decode = True  # False: CPU decode steps run the general path too (comparisons)
        self._qk_weights = None  # per layer [Hq + Hkv, D], built at the first lone decode step

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
        if batch == 1 and n_tokens == 1 and self._lone_path_applies():
            position = int(positions[0, 0])
            slots = getattr(cache, "lone_slots", lambda _: None)(position)
            if slots is not None:
                return self._forward_lone(int(tokens[0, 0]), position, cache, *slots)
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

    def _lone_path_applies(self) -> bool:
        cfg = self.config
        return (self.lone_decode and self.device.type == "cpu" and self.dtype == torch.float32 and self.moe_fn is None
                and self.moe_path == "auto" and cfg.sliding_window is None)

    def _forward_lone(self, token: int, position: int, cache, slot: int, runs) -> torch.Tensor:
        """`forward` for one sequence's one new token at the end of its cache (CPU, fp32).

        cache.lone_slots gave the flat slot this token's K/V go to and the [start, end) slot
        runs that hold positions 0..position; `cache.layer_stores(i)` gives layer i's flat key
        and value stores [slots, Hkv, D]. The query sees every key, so no mask is built. The ops
        differ from the general path only in rounding (summation order, RoPE as one matmul).
        """
        cfg = self.config
        eps, hidden, d = cfg.rms_norm_eps, (cfg.hidden_size,), cfg.head_dim
        n_qk = (cfg.num_heads + cfg.num_kv_heads) * d
        if self._qk_weights is None:
            self._qk_weights = self._lone_qk_weights()
        cos, sin = ref.rope_cos_sin(torch.tensor([position]), self.inv_freq, self.dtype)
        rope = ref.rope_matrix(cos[0], sin[0])
        x = self.embed[token : token + 1]  # a view: every update below makes a new tensor
        for index, layer in enumerate(self.layers):
            h = F.rms_norm(x, hidden, layer.input_norm, eps)
            qkv = F.linear(h, layer.w_qkv, layer.b_qkv)[0]
            # q and k heads: one norm (weights per head row), then RoPE for all of them at once.
            qk = F.rms_norm(qkv[:n_qk].view(-1, d), (d,), None, eps) * self._qk_weights[index]
            qk = torch.mm(qk, rope)
            keys, values = cache.layer_stores(index)
            keys[slot].copy_(qk[cfg.num_heads :])
            values[slot].copy_(qkv[n_qk:].view(-1, d))
            out = ref.attention_lone(qk[: cfg.num_heads], [keys[a:b] for a, b in runs],
                                     [values[a:b] for a, b in runs])
            if layer.b_o is None:  # the residual add inside the product
                x = torch.addmm(x, out.view(1, -1), layer.w_o.t())
            else:
                x = x + F.linear(out.view(1, -1), layer.w_o, layer.b_o)
            h = F.rms_norm(x, hidden, layer.post_attention_norm, eps)
            if layer.router is None:
                x = x + ref.dense_mlp(h, layer.w_gate_up, layer.w_down)
            else:
                x = self._moe_lone(x, h, layer)
        x = F.rms_norm(x, hidden, self.final_norm, eps)
        return F.linear(x, self.lm_head)[None]

    def _lone_qk_weights(self) -> list[torch.Tensor]:
        """Per layer, the q_norm weight for each query head row and k_norm for each key head row;
        the query rows also carry attention's 1/sqrt(D) (exact when D is a power of 4, as 64 is)."""
        cfg = self.config
        scale = 1.0 / math.sqrt(cfg.head_dim)
        return [torch.cat([(layer.q_norm * scale).expand(cfg.num_heads, -1),
                           layer.k_norm.expand(cfg.num_kv_heads, -1)]) for layer in self.layers]

    def _moe_lone(self, x: torch.Tensor, h: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """x + MoE(h) for one token [1, H]: routing in Python (8 logits), each chosen expert read
        in place and added into the residual with its routing weight inside the product."""
        cfg = self.config
        inter = layer.w_down.shape[2]
        logits = F.linear(h, layer.router)[0].tolist()
        for expert, weight in ref.route_one(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob):
            gate_up = F.linear(h, layer.w_gate_up[expert])
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            x = torch.addmm(x, act, layer.w_down[expert].t(), alpha=weight)
        return x

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
