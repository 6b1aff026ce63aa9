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


@dataclass
class _LoneLayer:
    """What the lone decode path reads of a layer, prepared once: each weight matrix it
    multiplies by, transposed into a contiguous [in, out] copy, and the q/k norm weights per
    head row. A one-row product streams the [in, out] layout about 1.3-1.8x faster on the CPU
    (MKL's kernel for the transposed [out, in] case is slower than memory), at the cost of a
    second copy of those weights. Derived from the weights when built: weights changed later
    are not seen (nothing in the engine changes them)."""

    qk_norm: torch.Tensor  # [Hq + Hkv, D]: q_norm (times attention's 1/sqrt(D)) per query head, k_norm per key head
    w_qkv: torch.Tensor  # [H, (Hq + 2 Hkv) D]
    w_o: torch.Tensor  # [Hq D, H]
    gate_up: torch.Tensor | None  # MoE: [E, H, 2I]
    down: torch.Tensor | None  # MoE: [E, I, H]

    @classmethod
    def of(cls, layer: LayerWeights, cfg: ModelConfig) -> "_LoneLayer":
        # The scale is exact when D is a power of 4 (64 is): scores come out bit-identical.
        scale = 1.0 / math.sqrt(cfg.head_dim)
        qk_norm = torch.cat([(layer.q_norm * scale).expand(cfg.num_heads, -1),
                             layer.k_norm.expand(cfg.num_kv_heads, -1)])
        moe = layer.router is not None
        return cls(qk_norm, _k_major(layer.w_qkv), _k_major(layer.w_o),
                   _k_major(layer.w_gate_up) if moe else None, _k_major(layer.w_down) if moe else None)


def _k_major(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(-1, -2).contiguous()


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
        self._lone = None  # per-layer `_LoneLayer`, built at the first lone decode step

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
        eps, d, n_q = cfg.rms_norm_eps, cfg.head_dim, cfg.num_heads
        n_qk = (n_q + cfg.num_kv_heads) * d
        if self._lone is None:
            self._lone = [_LoneLayer.of(layer, cfg) for layer in self.layers]
            self._lone_lm_head = _k_major(self.lm_head)  # [H, V]
            self._eps = torch.tensor(eps)
        cos, sin = ref.rope_cos_sin(torch.tensor([position]), self.inv_freq, self.dtype)
        rope = ref.rope_matrix(cos[0], sin[0])
        x = self.embed[token : token + 1]  # a view: every update below makes a new tensor
        for index, (layer, lone) in enumerate(zip(self.layers, self._lone)):
            h = _rms_norm_row(x, layer.input_norm, eps)
            qkv = torch.mm(h, lone.w_qkv) if layer.b_qkv is None else torch.addmm(layer.b_qkv, h, lone.w_qkv)
            qkv = qkv.view(-1, d)  # q, k, v heads as rows
            # q and k heads: one norm (weights per head row), then RoPE for all of them at once.
            qk = qkv[: n_qk // d]
            inv_rms = torch.add(self._eps, torch.linalg.vecdot(qk, qk), alpha=1 / d).rsqrt_()
            qk = torch.mm(torch.mul(qk, lone.qk_norm).mul_(inv_rms[:, None]), rope)
            keys, values = cache.layer_stores(index)
            keys[slot].copy_(qk[n_q:])
            values[slot].copy_(qkv[n_qk // d :])
            out = ref.attention_lone(qk[:n_q], [keys[a:b] for a, b in runs], [values[a:b] for a, b in runs])
            x = torch.addmm(x, out.view(1, -1), lone.w_o)  # the residual add inside the product
            if layer.b_o is not None:
                x = x + layer.b_o
            h = _rms_norm_row(x, layer.post_attention_norm, eps)
            if layer.router is None:
                x = x + ref.dense_mlp(h, layer.w_gate_up, layer.w_down)
                continue
            # MoE: routing in Python (a handful of logits), each chosen expert read in place and
            # added into the residual with its routing weight inside the product.
            logits = F.linear(h, layer.router)[0].tolist()
            for expert, weight in ref.route_one(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob):
                gate, up = torch.mm(h, lone.gate_up[expert]).view(2, -1)
                x = torch.addmm(x, F.silu(gate).mul_(up)[None], lone.down[expert], alpha=weight)
        return torch.mm(_rms_norm_row(x, self.final_norm, eps), self._lone_lm_head)[None]

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


def _rms_norm_row(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`ref.rms_norm` of one fp32 row x [1, H] in three ops instead of about ten: the mean
    square is read out as a Python float and the scaling folded into one addcmul."""
    flat = x.view(-1)
    inv_rms = 1.0 / math.sqrt(torch.dot(flat, flat).item() / flat.shape[0] + eps)
    return torch.addcmul(torch.zeros_like(x), x, weight, value=inv_rms)
