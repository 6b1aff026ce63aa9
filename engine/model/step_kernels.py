"""Which kernels the CUDA decode step launches: `StepKernels` (chosen when the step is built) and
`StepOps` (the step's operations over them, one method per fusable stage).

A decode step at small batch is bound by kernel launches, not bytes. Each fusion removes
launches from every layer, and each can be switched off, so a benchmark times the step with and
without it in one run (`engine.bench.decode`: its step variants add one fusion at a time):

- "norm_qkv": the residual add and RMSNorm before attention run inside the q/k/v projection
  (kernels.gemv.norm_linear), which recomputes the norm in each program;
- "router": the add and RMSNorm before the MoE, the router's matmul and its softmax/top-k in one
  launch (kernels.router.norm_route);
- "qkv_epilogue": the q/k RMSNorm, RoPE and K/V store run as the q/k/v projection's epilogue
  (kernels.gemv.heads_linear: the last program of each head hands it on), which takes the
  Triton GEMV; without it they are a launch of their own (kernels.fused_ops.AttentionHeads.store);
- "attention_merge": the last split of each head merges the splits (kernels.paged_attention);
- "gemv": the q/k/v and o projections of plain weights on the Triton GEMV, which splits K to
  fill the GPU (quantized weights always take it; plain ones otherwise take cuBLAS, or the GEMV
  where its tuned table measured it faster: kernels.quant_linear);
- "pdl": every Triton kernel of the step is a link of a programmatic-dependent-launch chain
  (kernels.pdl), so each starts, and loads its first weights, while the previous one drains;
  the q/k/v and o projections then run as Triton GEMVs, which can be links.

Without a fusion the step runs the separate kernels, which compute the same values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kernels.fused_ops import AttentionHeads, add_rms_norm
from kernels.paged_attention import paged_decode_attention
from kernels.quant import Weight, format_name
from kernels.quant_linear import linear

NORM_QKV = "norm_qkv"
QKV_EPILOGUE = "qkv_epilogue"
ROUTER = "router"
ATTENTION_MERGE = "attention_merge"
GEMV = "gemv"
PDL = "pdl"
FUSIONS = (NORM_QKV, QKV_EPILOGUE, ROUTER, ATTENTION_MERGE, GEMV, PDL)
# Stages of a PDL step that can be left out of the chain: warp decode's pair, the q/k/v and o
# projections.
UNLINKABLE = ("moe", "projections")
# The engine's step takes a fusion once a GPU run of engine.bench.decode has shown it giving the
# unfused step's logits and a faster step (BENCHMARKS.md, "The fused decode step"): the router's
# in every format; the others were slower there.
DEFAULT_FUSIONS: frozenset[str] = frozenset({ROUTER})
# The PDL chain as well, by the projections' format (`step_format`), for steps of up to this
# many rows: where the whole step measured faster with it (BENCHMARKS.md, "Tuned GEMV tiles and
# quantized lm_heads"): FP8 at 1 and 8 rows; bf16 with tuned GEMV tables at 1 (at 8 its
# projections' GEMV loses to cuBLAS); int4 at 1 since warp decode's int4 tiles were tuned
# ("The tuned quantized tables in the step").
PDL_MAX_ROWS = {"fp8": 8, "bf16": 1, "int4": 1}
# A PDL step of up to this many rows also runs the q/k/v projection's epilogue: at one row it
# measured faster in FP8 and int4 and the same in bf16; at 8 rows FP8 lost 0.3% (BENCHMARKS.md,
# "The q/k/v GEMV's epilogue").
QKV_EPILOGUE_MAX_ROWS = 1
# The fused router's experts a program in a step of one row: one (a warp, whose top-k is
# shuffles only) measured faster there than kernels.router's default of eight (BENCHMARKS.md,
# "The tuned quantized tables in the step"); other row counts are untimed and keep the default.
ONE_ROW_ROUTER_BLOCK_E = 1


def step_format(w_qkv: Weight, w_o: Weight) -> str:
    """The attention projections' format as default_fusions reads it: "fp8" or "int4" (the
    Triton GEMV reads them in any case), "bf16" where that GEMV has tuned tables for both
    sizes (the PDL chain moves them off cuBLAS, which wins at untuned sizes), else "plain"."""
    fmt = format_name(w_qkv)
    if fmt != "bf16":
        return fmt
    from kernels.gemv import is_tuned

    tuned = all(w.dtype == torch.bfloat16 and is_tuned("bf16", *w.shape) for w in (w_qkv, w_o))
    return "bf16" if tuned else "plain"


def default_fusions(weight_format: str, rows: int) -> frozenset[str]:
    """The engine's fusions for a step of `rows` rows over projections in `weight_format`
    (`step_format`)."""
    if rows > PDL_MAX_ROWS.get(weight_format, 0):
        return DEFAULT_FUSIONS
    if rows <= QKV_EPILOGUE_MAX_ROWS:
        return DEFAULT_FUSIONS | {PDL, QKV_EPILOGUE}
    return DEFAULT_FUSIONS | {PDL}


@dataclasses.dataclass(frozen=True)
class StepKernels:
    """The kernels a decode step launches. The defaults are the engine's; benchmarks pass others
    (to time a stage without its kernel, or to compare kernels) when they build the step."""

    attention: Callable = paged_decode_attention  # paged_decode_attention's signature
    # The o projection (and q/k/v without "norm_qkv"); None: kernels.quant_linear.linear, or
    # the Triton GEMV with "gemv" or when the step is a PDL chain.
    linear: Callable | None = None
    n_splits: int | None = None  # attention splits; None: default_splits for the step's shape
    # None: the engine's choice for the step's weight format and rows (default_fusions)
    fusions: frozenset[str] | None = None
    # Experts per program of the fused router (kernels.router.norm_route); None: the engine's
    # (ONE_ROW_ROUTER_BLOCK_E in a step of one row, else the kernel's default).
    router_block_e: int | None = None
    # Stages launched outside the PDL chain (UNLINKABLE), the rest staying links: to time which
    # kernels lose from starting early.
    unlinked: frozenset[str] = frozenset()

    def __post_init__(self):
        unknown = set(self.fusions or ()) - set(FUSIONS)
        if unknown:
            raise ValueError(f"unknown fusions {sorted(unknown)}; known: {FUSIONS}")
        if set(self.unlinked) - set(UNLINKABLE):
            raise ValueError(f"unlinkable stages are {UNLINKABLE}, got {sorted(self.unlinked)}")


DEFAULT_KERNELS = StepKernels()


class StepOps:
    """The fusable stages of a decode step of `rows` rows on `device`, as `kernels` chose them
    (or, where they name no fusions, as default_fusions does for `weight_format`).

    Fusions that need CUDA-sized kernels (GEMV rows, a plain tensor input) fall back to the
    separate kernels where they don't apply, so every step computes the same values."""

    def __init__(
        self,
        kernels: StepKernels,
        rows: int,
        n_kv_heads: int,
        eps: float,
        device,
        weight_format: str = "plain",
    ):
        from kernels.gemv import MAX_ROWS

        fusions = kernels.fusions
        if fusions is None:
            fusions = default_fusions(weight_format, rows)
        self.fusions = fusions
        self.eps = eps
        self.attention_fn = kernels.attention
        self.pdl = PDL in fusions and torch.device(device).type == "cuda"
        self.pdl_moe = self.pdl and "moe" not in kernels.unlinked
        self.pdl_projections = self.pdl and "projections" not in kernels.unlinked
        self.router_block_e = kernels.router_block_e or (
            ONE_ROW_ROUTER_BLOCK_E if rows == 1 else None
        )
        gemv_rows = rows <= MAX_ROWS
        self.norm_qkv = NORM_QKV in fusions and gemv_rows and kernels.linear is None
        self.qkv_epilogue = QKV_EPILOGUE in fusions and gemv_rows and kernels.linear is None
        self.router = ROUTER in fusions
        self.attention_merge = (
            ATTENTION_MERGE in fusions and kernels.attention is paged_decode_attention
        )
        if kernels.linear is not None:
            self.linear = kernels.linear
        elif (self.pdl or GEMV in fusions) and gemv_rows:
            self.linear = self._gemv
        else:
            self.linear = linear
        # Counters of the kernels that finish in their last program: zero between launches
        # (each launch resets what it used), so one buffer serves every layer and every replay.
        self.router_counters = torch.zeros(rows, dtype=torch.int32, device=device)
        self.attention_counters = torch.zeros(rows * n_kv_heads, dtype=torch.int32, device=device)

    def _gemv(self, x, w, bias=None):
        from kernels.gemv import skinny_linear

        return skinny_linear(x, w, bias, pdl=self.pdl_projections)

    def norm_linear(self, x, delta, norm_weight, w, bias):
        """(s, linear(rms_norm(s) * norm_weight, w, bias)) with s = x + delta."""
        if self.norm_qkv:
            from kernels.gemv import norm_linear

            return norm_linear(x, delta, norm_weight, self.eps, w, bias, pdl=self.pdl_projections)
        x, h = add_rms_norm(x, delta, norm_weight, self.eps, pdl=self.pdl)
        return x, self.linear(h, w, bias)

    def attention_inputs(self, x, delta, norm_weight, w, bias, heads: AttentionHeads):
        """(s, q) with s = x + delta: the q/k/v projection of rms_norm(s) * norm_weight, its
        heads normed, rotated and stored where `heads` says; q [rows, Hq, D]."""
        if not self.qkv_epilogue:
            x, qkv = self.norm_linear(x, delta, norm_weight, w, bias)
            return x, heads.store(qkv, self.pdl)
        from kernels.gemv import heads_linear

        pdl = self.pdl_projections
        if self.norm_qkv:
            return heads_linear(x, w, bias, heads, delta, norm_weight, self.eps, pdl=pdl)
        x, h = add_rms_norm(x, delta, norm_weight, self.eps, pdl=self.pdl)
        return x, heads_linear(h, w, bias, heads, pdl=pdl)[1]

    def norm_route(self, x, delta, norm_weight, router, top_k: int, norm_topk_prob: bool):
        """(s, h = rms_norm(s) * norm_weight, routing) with s = x + delta; routing is
        (topk_ids, topk_weights) when the router ran here, else None (dense layers, or the
        MoE routes h itself)."""
        if self.router and router is not None:
            from kernels.router import norm_route

            s, h, ids, weights = norm_route(
                x,
                delta,
                norm_weight,
                self.eps,
                router,
                top_k,
                norm_topk_prob,
                counters=self.router_counters,
                pdl=self.pdl,
                block_e=self.router_block_e,
            )
            return s, h, (ids, weights)
        x, h = add_rms_norm(x, delta, norm_weight, self.eps, pdl=self.pdl)
        return x, h, None

    def attention(self, *args, n_splits: int):
        """The step's paged decode attention (paged_decode_attention's arguments)."""
        if self.attention_fn is not paged_decode_attention:  # a benchmark's stand-in
            return self.attention_fn(*args, n_splits=n_splits)
        merge = {}
        if self.attention_merge:
            merge = dict(fused_merge=True, counters=self.attention_counters)
        return paged_decode_attention(*args, n_splits=n_splits, pdl=self.pdl, **merge)
