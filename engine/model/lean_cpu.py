"""The lean CPU forward: a few rows of one sequence through a small fp32 model.

On a small CPU a decode step's cost is memory traffic plus the fixed cost of each small op. This
forward computes the decoder layer (engine.model.layer) in under a third of the general path's
ops, over weight copies made for products of a few rows (`LeanLayer`, in the form the model's
options name: engine.model.lean_matrices): each RMSNorm weight folded into the product that
follows, RoPE of every head as one product, routing in Python, each chosen expert read once for
the rows routed to it, the residual added inside the products. With fp32 weights it differs from
the general path in rounding alone.

One row is a vector x [H] and n rows are x [n, H]: the same code computes both, the shapes
differing in a leading dimension alone, so that a decode step's token takes matrix-vector
products and a norm scale that is a Python float, the leanest form of each op.

One layer computation serves every use; they differ only in how attention reads the cache:
- `CacheRows`: new rows at the end of one sequence's cache, causal among themselves: a decode
  step's token, [last token] + a speculative draft (engine.decoding.prompt_lookup), or a short
  prompt's tokens, whose rows cost far less than as many steps: the weights are read once for
  all of them;
- `BeamRows`: a beam search's beams at one position (engine.decoding.beam_search): each sees the
  prompt's keys, which every beam shares and none writes, then its own beam's keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from engine.kv.cache import LeanRows, ModelCache
from engine.model import lean_matrices
from engine.model.config import ModelConfig
from engine.model.layer import LayerWeights
from kernels import reference as ref

if TYPE_CHECKING:
    from engine.model.qwen3_moe import Qwen3MoeModel

LeanMatrix = (
    lean_matrices.Fp32Matrix
    | lean_matrices.Int8Matrix
    | lean_matrices.Int4Matrix
    | lean_matrices.ModelFp32Matrix
)
# Attention of one layer's rows: (layer index, q [..., Hq, D] scaled, k, v [..., Hkv, D]) -> the
# rows' outputs [..., Hq, D], with `...` the rows' leading dimension (none for one row).
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# The most rows of a draft's or a beam search's lean forward: a decode step's token and a
# speculative draft behind it, or a beam search's beams (engine.ipc.protocol.MAX_BEAMS at most).
LEAN_MAX_ROWS = 9
# The most tokens of a prompt one lean forward computes (a cache hit's new tokens, a short cold
# prompt): up to about this many rows the lean forward's one pass over the stored weights beats
# the general path's expert-by-expert products over fp32 copies (BENCHMARKS.md, "Short prompt
# tails on the lean CPU forward").
LEAN_PROMPT_MAX_ROWS = 32
# With int8 weights, the logits within this much of a row's best are computed again in fp32
# (`LeanCpu.logits`): over held-out decode steps the int8 lm_head moved the shipped model's
# logits by well under half of it, so fp32's best stays among them; a step recomputes a handful.
LEAN_EXACT_MARGIN = 1.0
# With int4 weights (bf16 activations, the arithmetic the model was trained through) and the guard
# on (ModelOptions.lean_guard; off by default, since the unguarded step already changes fewer greedy
# answers than a bf16 engine does: BENCHMARKS.md), a step is computed again from the model's fp32
# weights unless it is decisive: every routing decision (the gap between the last expert a row chose
# and the first it left out, in router logits) at least ROUTE_MARGIN, and every row's best logit at
# least LOGIT_MARGIN above its second. Over held-out greedy steps every large move of the int4
# step's logits came at a routing near-tie, and steps clear of one moved well under LOGIT_MARGIN / 2
# (BENCHMARKS.md, engine.bench.lean_deviation), so a decisive step picks what fp32 picks. The
# earlier rows' K/V stay the int4 step's: the measurement above kept them too. Only the rows whose
# answer is used count: a draft's rows past the first one greedy rejects are thrown away
# (`_rows_used`). A routing near-tie in a used row is known before the step ends, so the int4 step
# stops there (`_Undecided`) instead of computing layers whose result is dropped.
ROUTE_MARGIN = 0.01
LOGIT_MARGIN = 0.3


class _Undecided(Exception):
    """An int4 forward met a routing near-tie in a row whose answer is used."""


@dataclass
class LeanLayer:
    """What the lean forward reads of a layer, prepared once: its matrices in the form the
    model's options name (engine.model.lean_matrices), each RMSNorm weight in front of a product
    folded into it, so a norm is one scalar per row."""

    # [Hq + Hkv, D]: q_norm (times attention's 1/sqrt(D)) per query head, k_norm per key head
    qk_norm: torch.Tensor
    w_qkv: LeanMatrix  # [(Hq + 2 Hkv) D, H], input_norm folded in
    b_qkv: torch.Tensor  # [(Hq + 2 Hkv) D], zeros without a bias
    w_o: LeanMatrix  # [H, Hq D]
    # MoE: [E, H] fp32 in every form (routing is brittle), post_attention_norm folded in
    router: torch.Tensor | None
    gate_up: tuple[LeanMatrix, ...]  # MoE, per expert [2I, H], post_attention_norm folded in
    down: tuple[LeanMatrix, ...]  # MoE, per expert [H, I]

    @classmethod
    def of(
        cls, layer: LayerWeights, cfg: ModelConfig, form: str, group: int = 32, codes=None
    ) -> LeanLayer:
        """`group`: the int4 form's group size; `codes`: the int4 (values, scales) of each of
        `projections(layer)`, in its order, where they are known."""
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
        weights = projections(layer)
        pending = iter(zip(weights, codes or [None] * len(weights)))

        def matrix(in_scale=None):  # the next of `projections(layer)`
            w, w_codes = next(pending)
            return lean_matrices.matrix(form, w, in_scale, group, w_codes)

        n_experts = len(layer.w_gate_up) if moe else 0
        return cls(
            qk_norm,
            matrix(layer.input_norm),
            b_qkv,
            matrix(),
            (layer.router * norm) if moe else None,
            tuple(matrix(norm) for _ in range(n_experts)),
            tuple(matrix() for _ in range(n_experts)),
        )


def projections(layer: LayerWeights) -> list[torch.Tensor]:
    """The matrices of a layer the lean forward streams in its weights' form, in the order
    `LeanLayer.of` takes them: q/k/v, o, then each expert's gate/up, then each expert's down."""
    experts = list(layer.w_gate_up) + list(layer.w_down) if layer.router is not None else []
    return [layer.w_qkv, layer.w_o, *experts]


class CacheRows:
    """Attention of new rows at the end of one sequence's cache: their K/V go to the slots
    `lean_rows` gave, and row j sees the keys up to its own."""

    def __init__(self, cache: ModelCache, rows: LeanRows):
        self.cache, self.runs = cache, rows.runs
        # One row's K/V are written by plain indexing, rows' by one index_copy_.
        self.slots = rows.slots[0] if len(rows.slots) == 1 else torch.tensor(rows.slots)

    def __call__(self, index: int, q, k, v) -> torch.Tensor:
        keys, values = self.cache.layer_stores(index)
        key_runs = [keys[a:b] for a, b in self.runs]
        value_runs = [values[a:b] for a, b in self.runs]
        if q.dim() == 2:  # one row: it sees every key, so no mask is built
            keys[self.slots].copy_(k)
            values[self.slots].copy_(v)
            return ref.attention_lean(q, key_runs, value_runs)
        keys.index_copy_(0, self.slots, k)
        values.index_copy_(0, self.slots, v)
        return ref.attention_rows(q, key_runs, value_runs)


class BeamKeys(Protocol):
    """Each beam's own K/V beside the shared prompt (engine.decoding.beam_search.BeamTails)."""

    length: int  # tokens each beam holds

    def mark(self) -> object:
        """The K/V held now, for `restore`."""

    def restore(self, mark: object) -> None:
        """Back to the K/V held at `mark` (a step computed again extends them again)."""

    def extend(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the beams' new k, v [B, Hkv, D] to layer's; return its keys and values
        [B, t, Hkv, D]."""


class BeamRows:
    """Attention of B beams' rows at one position: each sees the prompt's slot runs, then its own
    beam's keys, which `tails` holds and gains here."""

    def __init__(self, cache: ModelCache, runs: list[tuple[int, int]], tails: BeamKeys):
        self.cache, self.runs, self.tails = cache, runs, tails

    def __call__(self, index: int, q, k, v) -> torch.Tensor:
        if q.dim() == 2:  # one beam, computed as a vector: as a row of one here
            return self(index, q[None], k[None], v[None])[0]
        tail_keys, tail_values = self.tails.extend(index, k, v)
        keys, values = self.cache.layer_stores(index)
        return ref.attention_beams(
            q,
            [keys[a:b] for a, b in self.runs],
            [values[a:b] for a, b in self.runs],
            tail_keys,
            tail_values,
        )


class LeanCpu:
    """The model's lean CPU forward, its weight copies in `form`, built on first use (or by
    `prepare`)."""

    def __init__(self, model: Qwen3MoeModel, form: str, guarded: bool = False):
        """`form`: one of lean_matrices.FORMS, or "auto": int4 where the model's projections are
        int4 groups exactly (lean_matrices.int4_codes), else fp32. `guarded`: int4 steps that are
        not decisive are computed again from the fp32 weights (`_checked`)."""
        self.model = model
        self.group = 32  # the int4 form's group size
        # Per layer, the int4 (values, scales) of its projections, until prepared.
        self._int4_codes: list[list] | None = None
        if form in ("auto", "int4"):
            per_layer = [projections(layer) for layer in model.layers]
            found = lean_matrices.int4_codes(w for ws in per_layer for w in ws)
            self.group = found[0] if found else None
            if found:
                codes = iter(found[1])
                self._int4_codes = [[next(codes) for _ in ws] for ws in per_layer]
        if form == "int4" and self.group is None:
            raise ValueError(
                "int4 decode weights need a model trained through int4 groups: this model's "
                "projections are not int4 groups exactly (use fp32 or int8)"
            )
        if form == "auto":
            exact_int4 = self.group is not None and lean_matrices.int4_available()
            form = "int4" if exact_int4 else "fp32"
        if form != "int4":
            self._int4_codes = None
        self.form = form
        self.layers: list[LeanLayer] | None = None
        # int4: the same layers over the model's own fp32 weights, for steps that are not
        # decisive (ROUTE_MARGIN, LOGIT_MARGIN); None in the other forms.
        self.exact_layers: list[LeanLayer] | None = None
        # Whether int4 steps are checked (engine.bench.greedy_agreement measures both ways); it
        # means nothing in the other forms.
        self.guarded = guarded and form == "int4"
        self.steps = 0  # forwards of new rows (`tail`, `beams`)
        self.recomputed = 0  # of them, computed again from fp32 weights
        # While a guarded int4 forward runs: each row's closest routing decision so far, and how
        # many leading rows are used whatever the logits say (a near-tie in one ends the forward).
        self._row_routes: list[float] | None = None
        self._rows_always_used = 0
        cfg = model.config
        # Read in every layer of every step: looked up once.
        self.eps, self.head_dim = cfg.rms_norm_eps, cfg.head_dim
        self.q_heads, self.kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def prepare(self) -> None:
        if self.layers is not None:
            return
        model = self.model
        codes = self._int4_codes or [None] * len(model.layers)
        self.layers = [
            LeanLayer.of(layer, model.config, self.form, self.group, layer_codes)
            for layer, layer_codes in zip(model.layers, codes)
        ]
        self._int4_codes = None
        if self.form == "int4":
            self.exact_layers = [
                LeanLayer.of(layer, model.config, lean_matrices.MODEL_FP32)
                for layer in model.layers
            ]
        # The lm_head (the tied embedding) is not int4 in any checkpoint: int8 rows, with the
        # logits near the best recomputed from fp32 (`logits`).
        head_form = "int8" if self.form == "int4" else self.form
        self._lm_head = lean_matrices.matrix(head_form, model.lm_head, model.final_norm)
        self._eps = torch.tensor(model.config.rms_norm_eps)

    def tail(
        self,
        tokens: list[int],
        position: int,
        cache: ModelCache,
        exact_logits: bool = False,
        prompt: bool = False,
        last_only: bool = False,
    ) -> torch.Tensor | None:
        """Logits [n, V] (or [1, V] of the last row with `last_only`) of one sequence's n new
        tokens at positions position.. (the end of its cache); None where the cache cannot serve
        it or there are too many rows. `exact_logits`: every logit from the fp32 lm_head
        (`logits`). Without `prompt` the rows after the first verify a speculative draft (the
        guard checks the rows a verify uses); a prompt's tokens (up to LEAN_PROMPT_MAX_ROWS of
        them) have every row's routing checked by the guard."""
        if len(tokens) > (LEAN_PROMPT_MAX_ROWS if prompt else LEAN_MAX_ROWS):
            return None
        rows = cache.lean_rows(position, len(tokens))
        if rows is None:
            return None
        self.prepare()
        self.steps += 1
        rope, attend = self._rope(position, len(tokens)), CacheRows(cache, rows)
        # Computed again, a step's K/V overwrite the same slots: nothing to undo.
        draft = not prompt and len(tokens) > 1
        return self._checked(tokens, rope, attend, exact_logits, lambda: None, draft, last_only)

    def beams(
        self,
        tokens: list[int],
        position: int,
        cache: ModelCache,
        tails: BeamKeys,
        exact_logits: bool = False,
    ) -> torch.Tensor | None:
        """Logits [B, V] of B beams' newest tokens, all at `position`: each beam sees the cache's
        positions below position - tails.length (the prompt), then its own tokens in `tails`.
        None where the cache cannot serve it or there are too many beams. `exact_logits`: as
        for `tail`."""
        if len(tokens) > LEAN_MAX_ROWS:
            return None
        rows = cache.lean_rows(position - tails.length, 0)
        if rows is None:
            return None
        self.prepare()
        self.steps += 1
        rope, attend = self._rope(position, 1), BeamRows(cache, rows.runs, tails)
        mark = tails.mark()  # computed again, the step must not extend the beams' keys twice
        return self._checked(tokens, rope, attend, exact_logits, lambda: tails.restore(mark))

    def head(self, x: torch.Tensor, exact_logits: bool = False) -> torch.Tensor:
        """Logits [n, V] of residual rows x [n, H] (or [1, V] of one row x [H]): the final norm,
        then the lm_head (`logits`)."""
        h = _normed(x, self.eps)
        return self.logits(h if h.dim() == 2 else h[None], exact_logits)

    def logits(self, h: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """Logits [n, V] of normed rows h [n, H] (the final norm's weight not applied yet). With
        an int8 lm_head (the int8 and int4 forms), every logit within LEAN_EXACT_MARGIN of a
        row's best is computed again from the fp32 lm_head, so greedy picks as fp32 would unless
        int8's rounding moved a logit by half the margin; the rest stay int8's (sampling at a
        temperature sees them). A constrained choice (a healed text's first tokens) may pick far
        from the best: `exact` computes every logit from the fp32 lm_head."""
        self.prepare()
        model = self.model
        if exact and self.form != "fp32":
            return torch.mm(h * model.final_norm, model.lm_head.t())
        logits = self._lm_head.mm(h)
        if self.form == "fp32":
            return logits
        logits = logits.float()
        rows, cols = torch.nonzero(
            logits >= logits.amax(dim=-1, keepdim=True) - LEAN_EXACT_MARGIN, as_tuple=True
        )
        exact_best = torch.linalg.vecdot(model.lm_head[cols], (h * model.final_norm)[rows])
        return logits.index_put_((rows, cols), exact_best)

    def _rope(self, position: int, count: int) -> torch.Tensor:
        """RoPE of `count` rows from `position`: [D, D] for one, [count, D, D] for more."""
        inv_freq = self.model.inv_freq
        if count == 1:
            return ref.rope_matrix(position, inv_freq)
        return torch.stack(
            [ref.rope_matrix(p, inv_freq) for p in range(position, position + count)]
        )

    def _checked(
        self,
        tokens: list[int],
        rope: torch.Tensor,
        attend: Attend,
        exact_logits: bool,
        undo: Callable[[], None],
        draft: bool = False,
        last_only: bool = False,
    ) -> torch.Tensor:
        """`_forward` over the model's weights; in the int4 form, unless the step is decisive in
        the rows whose answer is used, computed again from the fp32 weights after `undo` (which
        forgets what the first attempt added). `draft`: the rows after the first verify a draft
        (`_rows_used`); otherwise every row is used. `last_only`: the last row's logits alone."""
        assert not (draft and last_only), "a draft's verification reads every row"
        if self.exact_layers is None or not self.guarded:
            return self._forward(tokens, rope, attend, self.layers, exact_logits, last_only)
        self._row_routes = [math.inf] * len(tokens)
        self._rows_always_used = 1 if draft else len(tokens)
        try:
            logits = self._forward(tokens, rope, attend, self.layers, exact_logits, last_only)
            used = _rows_used(tokens, logits) if draft else len(tokens)
            if self._decisive(logits, used):
                return logits
        except _Undecided:
            pass
        finally:
            self._row_routes = None
        self.recomputed += 1
        undo()
        return self._forward(tokens, rope, attend, self.exact_layers, exact_logits, last_only)

    def _decisive(self, logits: torch.Tensor, used: int) -> bool:
        """Whether the forward just run (its routing tracked) picks what fp32 would in its first
        `used` rows: no routing decision within ROUTE_MARGIN, no best logit within LOGIT_MARGIN
        of its second."""
        if min(self._row_routes[:used]) < ROUTE_MARGIN:
            return False
        best_two = logits[:used].topk(2, dim=-1).values
        return (best_two[:, 0] - best_two[:, 1]).min().item() >= LOGIT_MARGIN

    def _forward(
        self,
        tokens: list[int],
        rope: torch.Tensor,
        attend: Attend,
        layers: list[LeanLayer],
        exact_logits: bool = False,
        last_only: bool = False,
    ) -> torch.Tensor:
        """The decoder `layers` over rows of `tokens`, RoPE'd by rope ([D, D] for rows at one
        position, [n, D, D] per row), attention by `attend`; logits [n, V] (`logits`). While
        `_row_routes` is set, routing is tracked in it (`_track`)."""
        model = self.model
        if len(tokens) == 1:  # a vector, a view: every update below makes a new tensor
            x = model.embed[tokens[0]]
        else:
            x = model.embed[torch.tensor(tokens)]  # [n, H], a copy
        input_dtype = lean_matrices.INPUT_DTYPE[self.form if layers is self.layers else "fp32"]
        for index, (layer, lean) in enumerate(zip(model.layers, layers)):
            q, k, v = self._qkv(x, lean, rope)
            out = attend(index, q, k, v)
            out = out.view(-1) if x.dim() == 1 else out.reshape(x.shape[0], -1)  # [..., Hq D]
            x = lean.w_o.addmm(x, out)  # the residual added inside the product
            x = self._mlp(x, layer, lean, input_dtype)
        return self.head(x[-1:] if last_only and x.dim() == 2 else x, exact_logits)

    def _qkv(self, x: torch.Tensor, lean: LeanLayer, rope: torch.Tensor):
        """Rows x [..., H] -> q [..., Hq, D] (normed, rotated, scaled), k [..., Hkv, D] (normed,
        rotated), v [..., Hkv, D]."""
        d, n_q, n_qk = self.head_dim, self.q_heads, self.q_heads + self.kv_heads
        one = x.dim() == 1
        qkv = _normed_product(lean.w_qkv, lean.b_qkv, x, self.eps)
        # Heads as rows, [heads, D] or [n, heads, D], cut by basic slices (the cheapest views:
        # ops this small cost their dispatch, not their arithmetic).
        qkv = qkv.view(-1, d) if one else qkv.view(x.shape[0], -1, d)
        qk = qkv[:n_qk] if one else qkv[:, :n_qk]
        # q and k heads: one norm (weights per head row), then RoPE for all of them at once.
        inv_rms = torch.add(self._eps, torch.linalg.vecdot(qk, qk), alpha=1 / d).rsqrt_()
        qk = torch.matmul(torch.mul(qk, lean.qk_norm).mul_(inv_rms[..., None]), rope)
        if one:
            return qk[:n_q], qk[n_q:], qkv[n_qk:]
        return qk[:, :n_q], qk[:, n_q:], qkv[:, n_qk:]

    def _mlp(
        self,
        x: torch.Tensor,
        layer: LayerWeights,
        lean: LeanLayer,
        input_dtype: torch.dtype,
    ) -> torch.Tensor:
        """x [..., H] (attention's residual added) plus the layer's MLP or MoE of it, the
        experts' inputs in `input_dtype`."""
        if layer.b_o is not None:
            x = x + layer.b_o
        if layer.router is None:
            h = ref.rms_norm(x, layer.post_attention_norm, self.eps)
            return x + ref.dense_mlp(h, layer.w_gate_up, layer.w_down)
        # MoE: routing in Python (a handful of logits per row), each chosen expert read in place.
        h = _normed(x, self.eps)  # the norm's weight is in the router and expert copies
        logits = _router_logits(lean.router, h)
        if self._row_routes is not None:
            self._track(logits)
        h = h.to(input_dtype)  # once for every expert
        if x.dim() == 1:  # one row: each expert's output into the residual, weighted inside
            for expert, weight in ref.route_one(logits[0], self.top_k, self.norm_topk):
                gate, up = lean.gate_up[expert].mm(h).view(2, -1)
                x = lean.down[expert].addmm(x, F.silu(gate).mul_(up), alpha=weight)
            return x
        # Rows grouped by expert, so that each chosen expert's weights are read once.
        routed: dict[int, tuple[list[int], list[float]]] = {}
        for row, row_logits in enumerate(logits):
            for expert, weight in ref.route_one(row_logits, self.top_k, self.norm_topk):
                rows, weights = routed.setdefault(expert, ([], []))
                rows.append(row)
                weights.append(weight)
        for expert, (rows, weights) in routed.items():
            every = len(rows) == x.shape[0]  # no gather or scatter
            gate, up = lean.gate_up[expert].mm(h if every else h[rows]).chunk(2, dim=-1)
            y = torch.mul(
                lean.down[expert].mm(F.silu(gate).mul_(up)), torch.tensor(weights)[:, None]
            )  # fp32
            x = x.add_(y) if every else x.index_add_(0, torch.tensor(rows), y)
        return x

    def _track(self, logits: list[list[float]]) -> None:
        """Keep each row's closest routing decision; end the forward (`_Undecided`) at a
        near-tie in a row that is used whatever the logits say."""
        gaps = route_gaps(logits, self.top_k)
        self._row_routes = [min(a, b) for a, b in zip(self._row_routes, gaps)]
        if min(gaps[: self._rows_always_used]) < ROUTE_MARGIN:
            raise _Undecided


def _rows_used(tokens: list[int], logits: torch.Tensor) -> int:
    """How many leading rows of a draft's verification greedy decoding may read: row j picks
    the token after tokens[j], and the rows after the first whose pick rejects the draft are
    thrown away. A pick rejects the draft where the drafted token's logit is more than
    LOGIT_MARGIN below the row's best (within it, the row is decisive only if the drafted token
    is the best). The tokens greedy never picks (control tokens) are taken never to be a row's
    best by that much."""
    drafted = torch.tensor(tokens[1:])[:, None]
    below = logits[:-1].amax(dim=-1) - logits[:-1].gather(1, drafted)[:, 0]
    rejected = torch.nonzero(below > LOGIT_MARGIN)
    return len(tokens) if len(rejected) == 0 else int(rejected[0, 0]) + 1


# One row's RMSNorm scale is a Python float, which rides on the product that follows as its
# alpha instead of costing the ops of a per-row scale.
def _inv_rms_one(x: torch.Tensor, eps: float) -> float:
    """RMSNorm's 1/rms of one fp32 row x [H]."""
    return 1.0 / math.sqrt(torch.dot(x, x).item() / x.shape[0] + eps)


def _inv_rms_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's 1/rms of each row of fp32 x [n, H], as [n, 1]."""
    return torch.linalg.vecdot(x, x).div_(x.shape[-1]).add_(eps).rsqrt_()[:, None]


def _normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows x [..., H] RMS-normed (without a norm weight)."""
    return x * (_inv_rms_one(x, eps) if x.dim() == 1 else _inv_rms_rows(x, eps))


def _normed_product(w: LeanMatrix, add: torch.Tensor, x: torch.Tensor, eps: float):
    """add + (x RMS-normed) W^T for rows x [..., H], the norm's weight being folded into W."""
    if x.dim() == 1:
        return w.addmm(add, x, alpha=_inv_rms_one(x, eps))
    return w.addmm(add, x * _inv_rms_rows(x, eps))


def route_gaps(logits: list[list[float]], top_k: int) -> list[float]:
    """Each row's gap in router logits between the last expert chosen (of top_k) and the first
    left out: how near its routing decision came to going the other way."""
    gaps = []
    for row in logits:
        ordered = sorted(row, reverse=True)
        gaps.append(ordered[top_k - 1] - ordered[top_k] if len(row) > top_k else math.inf)
    return gaps


def closest_route(logits: list[list[float]], top_k: int) -> float:
    """The smallest of the rows' `route_gaps`."""
    return min(route_gaps(logits, top_k), default=math.inf)


def _router_logits(router: torch.Tensor, h: torch.Tensor) -> list[list[float]]:
    """Each row's router logits as Python floats."""
    if h.dim() == 1:
        return [torch.mv(router, h).tolist()]
    return torch.mm(h, router.t()).tolist()
