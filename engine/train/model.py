"""A compact pure-torch Qwen3-MoE for training, with parameter names equal to the Hugging Face
on-disk layout (`model.layers.L.mlp.experts.N.gate_proj.weight`, ...), so `state_dict()` is the
checkpoint. Semantics follow transformers' Qwen3MoeForCausalLM: per-head q/k RMSNorm before RoPE
(rotate-half), GQA, softmax router -> top-k -> renormalised weights, tied lm_head.

It computes with the inference layer's definitions (`kernels.reference`, which engine.model.layer
runs) where autograd allows: RMSNorm, RoPE, and the router's softmax, top-k and renormalisation.
Attention runs through `F.scaled_dot_product_attention` instead, whose fused kernels train on long
sequences without the [T, T] score matrix that `kernels.reference.attention` builds and autograd
would keep; the experts stay one `Linear` per projection, named as the checkpoint and each able to
train through FP8 or int4 rounding, where the inference layer's fused [E, 2I, H] tensors would
need a copy of every expert's weights at each step.

Only training needs this module; serving uses the engine, and tests check it against transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.loading import fp8, int4
from kernels import reference as ref


class Linear(nn.Linear):
    """nn.Linear (no bias) that can train through FP8 or int4 rounding: with `fp8_block` or
    `int4_group` set, the forward pass sees the weight as the shipped quantized checkpoint will
    hold it (quantization-aware training), while the optimizer keeps updating the full-precision
    weight."""

    fp8_block: int | None = None
    int4_group: int | None = None

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def effective_weight(self) -> torch.Tensor:
        if self.int4_group is not None:
            return int4.fake_quantize(self.weight, self.int4_group)
        return (
            self.weight
            if self.fp8_block is None
            else fp8.fake_quantize(self.weight, self.fp8_block)
        )

    def forward(self, x):
        return F.linear(x, self.effective_weight())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return ref.rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """fp32 cos/sin tables [T, D] of positions [T]."""
    inv_freq = ref.rope_inv_freq(head_dim, theta).to(positions.device)
    return ref.rope_cos_sin(positions, inv_freq, torch.float32)


def apply_rope(x, cos, sin):
    """RoPE in fp32 (cos, sin are), back in x's dtype."""
    return ref.apply_rope(x, cos, sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            c["num_attention_heads"],
            c["num_key_value_heads"],
            c["head_dim"],
        )
        h = c["hidden_size"]
        self.q_proj = Linear(h, self.n_heads * self.head_dim)
        self.k_proj = Linear(h, self.n_kv * self.head_dim)
        self.v_proj = Linear(h, self.n_kv * self.head_dim)
        self.o_proj = Linear(self.n_heads * self.head_dim, h)
        self.q_norm = RMSNorm(self.head_dim, c["rms_norm_eps"])
        self.k_norm = RMSNorm(self.head_dim, c["rms_norm_eps"])

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv  # GQA: kv head j serves q heads j*rep .. j*rep+rep-1
        k = (
            k[:, :, None]
            .expand(b, self.n_kv, rep, t, self.head_dim)
            .reshape(b, self.n_heads, t, self.head_dim)
        )
        v = (
            v[:, :, None]
            .expand(b, self.n_kv, rep, t, self.head_dim)
            .reshape(b, self.n_heads, t, self.head_dim)
        )
        q, k, v = q.to(v.dtype), k.to(v.dtype), v
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter)
        self.up_proj = Linear(hidden, inter)
        self.down_proj = Linear(inter, hidden)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# The grouped GEMM reads each expert's rows from a 16-row boundary (its TMA alignment on Hopper).
GROUP_ROWS = 16
MOE_FORMS = ("sparse", "dense", "grouped")


class SparseMoe(nn.Module):
    """Top-k MoE with three interchangeable forms of one function (`MOE_FORMS`):

    - sparse (expert-centric): sort token slots by expert, one matmul chain per expert. Least
      arithmetic, but data-dependent shapes and a host sync per layer.
    - dense: every expert on every token as three wide matmuls over the experts' stacked weights,
      with unrouted experts weighted exactly 0. E/top_k times the expert arithmetic, but static
      shapes and no sync, so `torch.compile` fuses the layer.
    - grouped: the sparse form's arithmetic with static shapes: token slots sorted by expert into
      one buffer of fixed size (each expert's rows padded with zero rows to GROUP_ROWS), and each
      projection one grouped GEMM (`torch._grouped_mm`) over all experts. No host sync, so it
      compiles like the dense form without the dense form's wasted experts.
    """

    def __init__(self, c: dict, form: str = "sparse"):
        super().__init__()
        if form not in MOE_FORMS:
            raise ValueError(f"MoE form {form!r} is not one of {MOE_FORMS}")
        self.top_k, self.n_experts, self.norm_topk = (
            c["num_experts_per_tok"],
            c["num_experts"],
            c["norm_topk_prob"],
        )
        self.form = form
        self.gate = nn.Linear(c["hidden_size"], self.n_experts, bias=False)
        self.experts = nn.ModuleList(
            Expert(c["hidden_size"], c["moe_intermediate_size"]) for _ in range(self.n_experts)
        )

    def route(self, x):
        # Every expert's probability: the routing picks from them, the balance loss averages them.
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top_i, top_w = ref.route_probs(probs, self.top_k, self.norm_topk)
        # Switch-style balance loss: experts' routed fraction times their mean router probability.
        routed = F.one_hot(top_i, self.n_experts).sum((0, 1)).float() / top_i.numel()
        aux = self.n_experts * (routed * probs.mean(0)).sum()
        return top_w, top_i, aux

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_w, top_i, aux = self.route(x)
        out = getattr(self, f"_{self.form}")(x, top_w, top_i)
        return out.reshape(shape), aux

    def _sparse(self, x, top_w, top_i):
        flat_e = top_i.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        token_of_slot = order // self.top_k
        counts = torch.bincount(flat_e, minlength=self.n_experts).tolist()
        xs = x[token_of_slot]
        outs = [
            self.experts[e](chunk) for e, chunk in enumerate(torch.split(xs, counts)) if counts[e]
        ]
        ys = torch.cat(outs) * top_w.reshape(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of_slot, ys.to(x.dtype))

    def _effective(self, name: str) -> list[torch.Tensor]:
        """One projection of every expert, as the forward pass sees it: E x [out, in]."""
        return [getattr(e, name).effective_weight() for e in self.experts]

    def _dense(self, x, top_w, top_i):
        n, inter = x.shape[0], self.experts[0].gate_proj.weight.shape[0]
        gate_w = torch.cat(self._effective("gate_proj"))  # [E*I, H]
        up_w = torch.cat(self._effective("up_proj"))  # [E*I, H]
        down_w = torch.cat(self._effective("down_proj"), 1)  # [H, E*I]
        # [N, E] routing weights, 0 for the experts a token is not routed to.
        weights = torch.zeros(n, self.n_experts, device=x.device, dtype=top_w.dtype).scatter(
            1, top_i, top_w
        )
        h = F.silu(F.linear(x, gate_w)) * F.linear(x, up_w)
        h = (h.view(n, self.n_experts, inter) * weights[:, :, None].to(h.dtype)).view(n, -1)
        return F.linear(h, down_w)

    def _grouped(self, x, top_w, top_i):
        n_slots = top_i.numel()
        rows = n_slots + self.n_experts * GROUP_ROWS  # static: enough for any routing
        flat_e = top_i.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        sorted_e = flat_e[order]
        # Counted by scatter, not bincount, whose output size depends on the data.
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat_e, torch.ones_like(flat_e)
        )
        padded = (counts + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS
        padded_end = torch.cumsum(padded, 0)
        start = torch.cumsum(counts, 0) - counts
        # The buffer row of each sorted slot: its expert's padded start plus its rank there.
        dest = (padded_end - padded - start)[sorted_e] + torch.arange(n_slots, device=x.device)
        # Group ends; the last group takes the buffer's spare rows (zeros in, zeros out), so
        # every row the GEMMs write is defined.
        ends = torch.cat([padded_end[:-1], padded.new_full((1,), rows)]).to(torch.int32)
        token_of_slot = order // self.top_k
        dtype = (
            torch.get_autocast_dtype(x.device.type)
            if torch.is_autocast_enabled(x.device.type)
            else x.dtype
        )
        xs = x.new_zeros(rows, x.shape[1], dtype=dtype).index_copy(
            0, dest, x[token_of_slot].to(dtype)
        )

        def grouped(a, name):  # a [rows, in] @ each expert's [out, in]^T -> [rows, out]
            w = torch.stack(self._effective(name)).to(dtype).transpose(1, 2)
            return torch._grouped_mm(a, w, offs=ends)

        h = F.silu(grouped(xs, "gate_proj")) * grouped(xs, "up_proj")
        # Weighted in fp32, as the sparse form does.
        ys = grouped(h, "down_proj")[dest].float() * top_w.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token_of_slot, ys.to(x.dtype))


class DecoderLayer(nn.Module):
    def __init__(self, c: dict, moe: str = "sparse"):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = SparseMoe(c, moe)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h, aux = self.mlp(self.post_attention_layernorm(x))
        return x + h, aux


class Backbone(nn.Module):
    def __init__(self, c: dict, moe: str = "sparse"):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(c, moe) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Qwen3MoeLM(nn.Module):
    def __init__(self, config: dict, moe: str = "sparse"):
        super().__init__()
        assert config["tie_word_embeddings"] and not config["mlp_only_layers"]
        self.config = config
        self.model = Backbone(config, moe)

    def init_weights(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        std = self.config["initializer_range"]
        n_layers = self.config["num_hidden_layers"]
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue  # RMSNorm gains stay at 1
            s = (
                std / (2 * n_layers) ** 0.5
                if name.endswith(("o_proj.weight", "down_proj.weight"))
                else std
            )
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * s)

    def set_fp8_training(self, block: int | None) -> None:
        """Train the projections (attention and experts; not the router, embedding or norms) through
        FP8 rounding with this block size, as the FP8 export will ship them; None turns it off."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.fp8_block = block

    def set_int4_training(self, group: int | None) -> None:
        """As `set_fp8_training`, through int4 rounding with this group size
        (`export --int4-group`)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.int4_group = group

    def forward(self, ids: torch.Tensor):
        """ids [B, T] -> (logits [B, T, V], mean router balance loss)."""
        t = ids.shape[1]
        cos, sin = rope_cos_sin(
            torch.arange(t, device=ids.device), self.config["head_dim"], self.config["rope_theta"]
        )
        x = self.model.embed_tokens(ids)
        aux = 0.0
        for layer in self.model.layers:
            x, a = layer(x, cos, sin)
            aux = aux + a
        x = self.model.norm(x)
        logits = F.linear(x, self.model.embed_tokens.weight)
        return logits, aux / len(self.model.layers)
