"""Qwen3-MoE forward pass over weights laid out for the kernels.

One `forward` serves prefill (many tokens) and decode (one token per sequence); the MoE layer
picks its path from the number of routed tokens. Numerics follow transformers' Qwen3-MoE.
On the CPU, one sequence's decode step of an fp32 model takes a leaner path (`_forward_lone`):
the same arithmetic in under a third of the ops, over weight copies made for a one-row product
(int8 by default, so a quarter of the bytes to stream, or fp32, which differs from the general
path in rounding alone: `lone_weights`, engine.model.lone_matrices); there a step's cost is memory
traffic plus the fixed cost of each small op.
`forward_tail` is the same lean path for a few new tokens of one sequence (a speculative draft's
verification, engine.decoding.prompt_lookup): all rows in one product per weight, causal among themselves.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv.contiguous import KVCache
from engine.model import host_load, lone_matrices
from engine.model.config import ModelConfig
from kernels import dispatch
from kernels import reference as ref

LoneMatrix = lone_matrices.Fp32Matrix | lone_matrices.Int8Matrix

MOE_PATHS = ("auto", "expert_centric", "output_centric")
# On the CPU, reading each routed expert in place (output-centric) wins while few tokens are
# routed; past this many (token, expert) pairs (measured crossover 4-8) the grouped path, which
# reads each expert once for all its tokens, is faster.
CPU_OUTPUT_CENTRIC_MAX_PAIRS = 4
# A CPU forward of at most this many tokens (decode steps, short prompts) runs on one intra-op
# thread: its ops are too small to gain from splitting, and while another process keeps a core
# busy each split op waits for a thread that cannot run (2-core host, cold single-line
# completion: p50 ~0.2 s on one thread, 1.5-3.7 s on two; a 22-token prefill 38 ms vs 2.5 s).
CPU_ONE_THREAD_MAX_TOKENS = 64
# A longer CPU forward (prefill of up to 512 tokens) gains from every thread on a free host
# (512 tokens: 205 ms on two, 286 on one) but collapses like the short ones when another
# process holds a core (0.6-6.1 s against 0.32 s). So it runs on as many threads as other
# processes left cores free (engine.model.host_load), give or take this much of a core, at least one:
# on 2 cores, two threads while others keep at most half a core busy, else one. Where the load
# is unknown, all threads, as before. Half a core:
# against a neighbour busy 25% of the time two threads still won (512 tokens: 255 vs 295 ms),
# at 50% they broke even, at 75% they lost (385 vs 340 ms); a neighbour on a whole core reads
# 0.6-1.1 busy cores, an idle host 0-0.4 (BENCHMARKS.md).
CPU_FREE_CORE_MARGIN = 0.5
# Both CPU measures above are for small models, whose steps are dominated by per-op cost: the lean
# decode step's weight copies double the weights' memory, and a big model's step streams enough
# bytes to gain from every core. Past this many weight bytes the general path runs as before.
CPU_SMALL_MODEL_MAX_BYTES = 1 << 30
# The lean CPU forward of a few rows serves at most this many: a decode step's token and a
# speculative draft behind it (`forward_tail`), or a beam search's beams (`forward_beams`,
# engine.ipc.protocol.MAX_BEAMS of them at most).
LONE_MAX_ROWS = 9
# With int8 lone weights, the logits within this much of a step's best are computed again in
# fp32 (`Qwen3MoeModel._lone_logits`). Over 234 decode steps on held-out files, the int8 lm_head
# moved the shipped model's logits by at most 0.30 (99.9% under 0.15; a step's logits span ~36),
# so fp32's best stays among them; a step recomputes a handful.
LONE_EXACT_MARGIN = 1.0
# Only OpenMP builds of torch change intra-op threads mid-process; elsewhere the call can warn
# and pin the whole process to the first setting.
_THREADS_ADJUSTABLE = "OpenMP" in torch.__config__.parallel_info()


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
    """What the lone decode path reads of a layer, prepared once: its matrices in the form the
    model's `lone_weights` names (engine.model.lone_matrices), each RMSNorm weight in front of a
    product folded into it, so a norm is one scalar."""

    qk_norm: (
        torch.Tensor
    )  # [Hq + Hkv, D]: q_norm (times attention's 1/sqrt(D)) per query head, k_norm per key head
    w_qkv: LoneMatrix  # [(Hq + 2 Hkv) D, H], input_norm folded in
    b_qkv: torch.Tensor  # [(Hq + 2 Hkv) D], zeros without a bias
    w_o: LoneMatrix  # [H, Hq D]
    router: (
        torch.Tensor | None
    )  # MoE: [E, H] fp32 in every form (routing is brittle), post_attention_norm folded in
    gate_up: tuple[LoneMatrix, ...]  # MoE, per expert [2I, H], post_attention_norm folded in
    down: tuple[LoneMatrix, ...]  # MoE, per expert [H, I]

    @classmethod
    def of(cls, layer: LayerWeights, cfg: ModelConfig, form: str) -> _LoneLayer:
        # The scale is exact when D is a power of 4 (64 is): scores come out bit-identical.
        scale = 1.0 / math.sqrt(cfg.head_dim)
        qk_norm = torch.cat(
            [
                (layer.q_norm * scale).expand(cfg.num_heads, -1),
                layer.k_norm.expand(cfg.num_kv_heads, -1),
            ]
        )
        b_qkv = (
            layer.b_qkv if layer.b_qkv is not None else layer.w_qkv.new_zeros(layer.w_qkv.shape[0])
        )
        moe = layer.router is not None
        norm = layer.post_attention_norm
        return cls(
            qk_norm,
            lone_matrices.matrix(form, layer.w_qkv, layer.input_norm),
            b_qkv,
            lone_matrices.matrix(form, layer.w_o),
            (layer.router * norm) if moe else None,
            tuple(lone_matrices.matrix(form, w, norm) for w in layer.w_gate_up) if moe else (),
            tuple(lone_matrices.matrix(form, w) for w in layer.w_down) if moe else (),
        )


@contextlib.contextmanager
def _intra_op_threads(count: int = 1):
    """Torch's intra-op threads set to `count` for the block (see CPU_ONE_THREAD_MAX_TOKENS and
    CPU_FREE_CORE_MARGIN). The engine runs all model work on one thread, whose setting this changes."""
    threads = torch.get_num_threads()
    if threads == count or not _THREADS_ADJUSTABLE:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _threads_for_long_forward() -> int:
    """Intra-op threads for a long small-model CPU forward: the configured number, less those
    other processes' busy cores would leave without a core (see CPU_FREE_CORE_MARGIN), at
    least one; the configured number where the load is unknown. Asked at every small-model CPU
    forward, decode steps included, so that while completions run the estimate a prefill reads
    covers about the last 50 ms (a look costs tens of µs and is reused for 50 ms)."""
    configured = torch.get_num_threads()
    load = host_load.others_busy_cores() if _THREADS_ADJUSTABLE else None
    if load is None:
        return configured
    others, cores = load
    return max(1, min(configured, math.floor(cores - others + CPU_FREE_CORE_MARGIN)))


def _weight_bytes(model: Qwen3MoeModel) -> int:
    tensors = [model.embed, model.lm_head, model.final_norm]
    for layer in model.layers:
        tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    unique = {t.data_ptr(): t for t in tensors}  # a tied lm_head is the embedding
    return sum(t.numel() * t.element_size() for t in unique.values())


def _inv_rms(x: torch.Tensor, eps: float) -> float:
    """RMSNorm's 1/rms of one fp32 vector, as a Python float (the scaling then rides on a
    product that follows, instead of the ten-odd small ops of a norm)."""
    return 1.0 / math.sqrt(torch.dot(x, x).item() / x.shape[0] + eps)


def _inv_rms_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's 1/rms of each row of fp32 x [n, H], as [n, 1]."""
    return torch.linalg.vecdot(x, x).div_(x.shape[-1]).add_(eps).rsqrt_()[:, None]


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
        # parallelism (`engine.model.expert_parallel`) sets it, since its layers hold only the local experts.
        self.moe_fn = None
        self.inv_freq = ref.rope_inv_freq(config.head_dim, config.rope_theta).to(self.device)
        self.lone_decode = True  # False: CPU decode steps run the general path too (comparisons)
        # The lone path's weights: "int8" (a quarter of fp32's bytes to stream a step, so faster;
        # engine.model.lone_matrices) on x86-64, else "fp32".
        self.lone_weights = lone_matrices.default_form()
        self._lone = None  # per-layer `_LoneLayer`, built by `prepare_lone_decode`
        self._lone_form = None
        self.small_on_cpu = (
            self.device.type == "cpu" and _weight_bytes(self) <= CPU_SMALL_MODEL_MAX_BYTES
        )

    def new_cache(self, batch: int, capacity: int = 256) -> KVCache:
        cfg = self.config
        return KVCache(
            cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, capacity, self.dtype, self.device
        )

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
        if not self.small_on_cpu:
            return self._forward(tokens, positions, cache, last_only)
        threads = _threads_for_long_forward()  # asked at every forward: keeps the estimate fresh
        with _intra_op_threads(threads if tokens.numel() > CPU_ONE_THREAD_MAX_TOKENS else 1):
            return self._forward(tokens, positions, cache, last_only)

    def _forward(self, tokens, positions, cache, last_only):
        cfg = self.config
        batch, n_tokens = tokens.shape
        if batch == 1 and n_tokens == 1 and self.lone_path_applies():
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
            if batch == 1 and self.lone_path_applies():
                # The lean path's lm_head: its layout (or int8) reads the 20 MB of a small
                # model's head ~4x faster than F.linear's one-row case (3.5 vs 0.9 ms).
                self.prepare_lone_decode()
                return self._lone_logits(x[0] * _inv_rms_rows(x[0], cfg.rms_norm_eps))[None]
        x = ref.rms_norm(x, self.final_norm, cfg.rms_norm_eps)
        return F.linear(x, self.lm_head).float()

    def lone_path_applies(self) -> bool:
        """Whether the lean CPU path runs: one sequence's decode steps, and the forwards of a few
        rows (`forward_tail`, `forward_beams`)."""
        cfg = self.config
        return (
            self.lone_decode
            and self.small_on_cpu
            and self.dtype == torch.float32
            and self.moe_fn is None
            and self.moe_path == "auto"
            and cfg.sliding_window is None
        )

    def prepare_lone_decode(self) -> None:
        """Build the lone decode path's weight copies (in the form `lone_weights` names) now rather
        than in the first completion's first step; a no-op where the path does not apply."""
        if self.lone_path_applies() and (
            self._lone is None or self._lone_form != self.lone_weights
        ):
            self._lone = [
                _LoneLayer.of(layer, self.config, self.lone_weights) for layer in self.layers
            ]
            self._lone_lm_head = lone_matrices.matrix(
                self.lone_weights, self.lm_head, self.final_norm
            )
            self._lone_form = self.lone_weights
            self._lone_input = lone_matrices.INPUT_DTYPE[self.lone_weights]
            self._eps = torch.tensor(self.config.rms_norm_eps)

    def _lone_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] of normed rows h [n, H] (the final norm's weight not applied yet). With
        int8 weights, every logit within LONE_EXACT_MARGIN of a row's best is computed again from
        the fp32 lm_head, so greedy picks as fp32 would unless int8's rounding moved a logit by
        half the margin; the rest stay int8's (sampling at a temperature sees them)."""
        logits = self._lone_lm_head.mm(h)
        if self._lone_form == "fp32":
            return logits
        logits = logits.float()
        rows, cols = torch.nonzero(
            logits >= logits.amax(dim=-1, keepdim=True) - LONE_EXACT_MARGIN, as_tuple=True
        )
        exact = torch.linalg.vecdot(self.lm_head[cols], (h * self.final_norm)[rows])
        return logits.index_put_((rows, cols), exact)

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
        self.prepare_lone_decode()
        rope = ref.rope_matrix(position, self.inv_freq)
        x = self.embed[token]  # [H], a view: every update below makes a new tensor
        for index, (layer, lone) in enumerate(zip(self.layers, self._lone)):
            qkv = lone.w_qkv.addmv(lone.b_qkv, x, alpha=_inv_rms(x, eps)).view(
                -1, d
            )  # heads as rows
            # q and k heads: one norm (weights per head row), then RoPE for all of them at once.
            qk = qkv[: n_qk // d]
            inv_rms = torch.add(self._eps, torch.linalg.vecdot(qk, qk), alpha=1 / d).rsqrt_()
            qk = torch.mm(torch.mul(qk, lone.qk_norm).mul_(inv_rms[:, None]), rope)
            keys, values = cache.layer_stores(index)
            keys[slot].copy_(qk[n_q:])
            values[slot].copy_(qkv[n_qk // d :])
            out = ref.attention_lone(
                qk[:n_q], [keys[a:b] for a, b in runs], [values[a:b] for a, b in runs]
            )
            x = lone.w_o.addmv(x, out.view(-1))  # the residual added in the same op
            if layer.b_o is not None:
                x = x + layer.b_o
            if layer.router is None:
                h = ref.rms_norm(x, layer.post_attention_norm, eps)
                x = x + ref.dense_mlp(h, layer.w_gate_up, layer.w_down)
                continue
            # MoE: routing in Python (a handful of logits), each chosen expert read in place and
            # added into the residual with its routing weight inside the product.
            h = x * _inv_rms(x, eps)  # the norm's weight is in the router and expert copies
            logits = torch.mv(lone.router, h).tolist()
            h = h.to(self._lone_input)  # once for both experts
            for expert, weight in ref.route_one(
                logits, cfg.num_experts_per_tok, cfg.norm_topk_prob
            ):
                gate, up = lone.gate_up[expert].mv(h).view(2, -1)
                x = lone.down[expert].addmv(x, F.silu(gate).mul_(up), alpha=weight)
        return self._lone_logits((x * _inv_rms(x, eps))[None]).view(1, 1, -1)

    @torch.inference_mode()
    def forward_tail(self, tokens: list[int], position: int, cache) -> torch.Tensor | None:
        """Logits [n, V] of every one of one sequence's n new tokens at positions position..
        (the end of its cache), by a lean CPU forward in the spirit of `_forward_lone`; None where
        that path does not apply (the caller then runs `forward`). Verifies a speculative draft:
        the weights are read once for all rows, so n rows cost far less than n decode steps."""
        if len(tokens) > LONE_MAX_ROWS or not self.lone_path_applies():
            return None
        rows = getattr(cache, "lone_rows", lambda *_: None)(position, len(tokens))
        if rows is None:
            return None
        with _intra_op_threads():
            return self._forward_rows(tokens, position, cache, *rows)

    def _forward_rows(
        self, tokens: list[int], position: int, cache, slots: torch.Tensor, runs
    ) -> torch.Tensor:
        """`_forward_lone` for n rows: products as x [n, in] @ W [in, out] on the same weight
        copies, each chosen expert read once for the rows routed to it, causal attention among
        the new rows. Differs from the general path only in rounding."""
        n = len(tokens)
        self.prepare_lone_decode()
        rope = torch.stack(
            [ref.rope_matrix(p, self.inv_freq) for p in range(position, position + n)]
        )
        x = self.embed[torch.tensor(tokens)]  # [n, H], a copy
        for index, (layer, lone) in enumerate(zip(self.layers, self._lone)):
            q, k, v = self._rows_qkv(x, lone, rope)
            keys, values = cache.layer_stores(index)
            keys.index_copy_(0, slots, k)
            values.index_copy_(0, slots, v)
            out = ref.attention_rows(
                q, [keys[a:b] for a, b in runs], [values[a:b] for a, b in runs]
            )
            x = self._rows_mlp(lone.w_o.addmm(x, out.reshape(n, -1)), layer, lone)
        return self._lone_logits(x * _inv_rms_rows(x, self.config.rms_norm_eps))

    @torch.inference_mode()
    def forward_beams(self, tokens: list[int], position: int, cache, tails) -> torch.Tensor | None:
        """Logits [B, V] of B beams' newest tokens, all at `position`, by the lean CPU forward of
        `_forward_rows`: each beam sees the cache's positions 0..position-1 (the prompt, which
        every beam shares and none writes) and then its own tokens, whose K/V `tails`
        (engine.decoding.beam_search.BeamTails) holds and gains here. None where the lean path does not
        apply: callers search only where `lone_path_applies()`, else they decode greedily."""
        if len(tokens) > LONE_MAX_ROWS or not self.lone_path_applies():
            return None
        rows = getattr(cache, "lone_rows", lambda *_: None)(position - tails.length, 0)
        if rows is None:
            return None
        runs = rows[1]
        n = len(tokens)
        self.prepare_lone_decode()
        rope = ref.rope_matrix(position, self.inv_freq)
        with _intra_op_threads():
            x = self.embed[torch.tensor(tokens)]  # [B, H], a copy
            for index, (layer, lone) in enumerate(zip(self.layers, self._lone)):
                q, k, v = self._rows_qkv(x, lone, rope)
                tail_keys, tail_values = tails.extend(index, k, v)
                keys, values = cache.layer_stores(index)
                out = ref.attention_beams(
                    q,
                    [keys[a:b] for a, b in runs],
                    [values[a:b] for a, b in runs],
                    tail_keys,
                    tail_values,
                )
                x = self._rows_mlp(lone.w_o.addmm(x, out.reshape(n, -1)), layer, lone)
            return self._lone_logits(x * _inv_rms_rows(x, self.config.rms_norm_eps))

    def _rows_qkv(self, x: torch.Tensor, lone: _LoneLayer, rope: torch.Tensor):
        """Rows x [n, H] -> q [n, Hq, D] (normed, rotated, scaled), k [n, Hkv, D] (normed,
        rotated), v [n, Hkv, D]; rope [n, D, D] per row, or [D, D] for rows at one position."""
        cfg = self.config
        d, n_q = cfg.head_dim, cfg.num_heads
        n_qk = n_q + cfg.num_kv_heads  # q and k heads
        h = x * _inv_rms_rows(x, cfg.rms_norm_eps)
        qkv = lone.w_qkv.addmm(lone.b_qkv, h).view(x.shape[0], -1, d)  # [n, heads, D]
        qk = qkv[:, :n_qk]
        inv_rms = torch.add(self._eps, torch.linalg.vecdot(qk, qk), alpha=1 / d).rsqrt_()
        qk = torch.matmul(torch.mul(qk, lone.qk_norm).mul_(inv_rms[..., None]), rope)
        return qk[:, :n_q], qk[:, n_q:], qkv[:, n_qk:]

    def _rows_mlp(self, x: torch.Tensor, layer: LayerWeights, lone: _LoneLayer) -> torch.Tensor:
        """x [n, H] (attention's residual added) plus the layer's MLP or MoE of it."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        if layer.b_o is not None:
            x = x + layer.b_o
        if layer.router is None:
            h = ref.rms_norm(x, layer.post_attention_norm, eps)
            return x + ref.dense_mlp(h, layer.w_gate_up, layer.w_down)
        # MoE: rows grouped by expert, so each chosen expert's weights are read once.
        n = x.shape[0]
        h = x * _inv_rms_rows(x, eps)
        routed: dict[int, tuple[list[int], list[float]]] = {}
        for row, logits in enumerate(torch.mm(h, lone.router.t()).tolist()):
            for expert, weight in ref.route_one(
                logits, cfg.num_experts_per_tok, cfg.norm_topk_prob
            ):
                rows, weights = routed.setdefault(expert, ([], []))
                rows.append(row)
                weights.append(weight)
        h = h.to(self._lone_input)
        for expert, (rows, weights) in routed.items():
            every = len(rows) == n  # no gather or scatter
            gate, up = lone.gate_up[expert].mm(h if every else h[rows]).chunk(2, dim=-1)
            y = torch.mul(
                lone.down[expert].mm(F.silu(gate).mul_(up)), torch.tensor(weights)[:, None]
            )  # fp32
            x = x.add_(y) if every else x.index_add_(0, torch.tensor(rows), y)
        return x

    def _attention(self, h, layer: LayerWeights, index, positions, cos, sin, cache: KVCache):
        cfg = self.config
        batch, n_tokens, _ = h.shape
        d = cfg.head_dim
        qkv = F.linear(h, layer.w_qkv, layer.b_qkv)
        q, k, v = qkv.split([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], dim=-1)
        q = ref.rms_norm(q.view(batch, n_tokens, cfg.num_heads, d), layer.q_norm, cfg.rms_norm_eps)
        k = ref.rms_norm(
            k.view(batch, n_tokens, cfg.num_kv_heads, d), layer.k_norm, cfg.rms_norm_eps
        )
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
        return (
            ref.moe_output_centric
            if pairs <= CPU_OUTPUT_CENTRIC_MAX_PAIRS
            else ref.moe_expert_centric
        )
