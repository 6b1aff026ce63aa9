"""Expert-centric fused MoE: the prefill path and the baseline warp decode has to beat.

Four launches:
1. `align_by_expert` groups the (token, slot) pairs by expert, padded to BLOCK_M rows.
2. `_gate_up_kernel`: grouped GEMM over row blocks, each block one expert; gate and up tiles
   of the same neurons are computed side by side so SiLU(gate) * up is applied in the epilogue
   (no separate activation launch, no [*, 2I] intermediate).
3. `_down_kernel`: grouped GEMM for the down projection, routing weight applied to the fp32
   accumulator, each slot's row written (activation dtype) to a [T*k, H] buffer.
4. The combine: a sum over the k slots of each token.

Each expert's output is rounded to the activation dtype before the combine (as vLLM's
fused_moe and Hugging Face do); warp decode keeps fp32 across experts instead.
Block sizes per batch size come from `kernels/configs/fused_moe_*.json` (tuned on the GPU).

Quantized weights (kernels.quant) are read as stored and dequantized in registers
(kernels.gemv.quantized_dot); BLOCK_K shrinks so that a K step never straddles two scales. FP8
tiles go to the dot as they are (exact in bf16) and each step's partial product is multiplied by
its blocks' scales, one per output column (as DeepSeek-style block GEMMs do); int4 tiles are
multiplied by their per-(row, group) scales and rounded to the activation dtype before the dot
(as W4A16 GEMMs do). No activation is quantized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import tuned
from kernels.moe_align import align_by_expert
from kernels.moe_inputs import moe_inputs
from kernels.quant import Weight, format_name, kernel_weight
from kernels.quant_tiles import k_step, quantized_dot, scale_weights
from kernels.triton_env import interpreting


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    # The interpreter cannot multiply bf16; the GPU should (fp32 accumulate either way).
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["numel"])
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    rows_used_ptr,
    numel,
    hidden,
    inter,
    top_k,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    FORMAT: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    PER_ITEM: tl.constexpr,
    SCALE_WEIGHTS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(rows_used_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = slots < numel
    tokens = (slots // top_k).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + inter * stride_wn

    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FORMAT == 0:
        for k0 in range(0, hidden, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                g = tl.load(g_ptrs, mask=mask_n[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                mask_k = (k0 + offs_k) < hidden
                a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                g = tl.load(g_ptrs, mask=mask_n[None, :] & mask_k[:, None], other=0.0)
                u = tl.load(u_ptrs, mask=mask_n[None, :] & mask_k[:, None], other=0.0)
            acc_gate = _dot(a, g, acc_gate, UPCAST)
            acc_up = _dot(a, u, acc_up, UPCAST)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    else:
        # Tiles [BLOCK_N, stored items] (int4 words run along K); scales per output row
        # (an FP8 block may hold gate and up rows alike).
        offs_c = tl.arange(0, BLOCK_K // PER_ITEM)
        g_ptrs = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_c[None, :]
        u_ptrs = g_ptrs + inter * stride_wn
        rows = tl.minimum(offs_n, inter - 1)  # masked rows read a real scale
        gs_rows = s_ptr + expert * stride_se + (rows // SCALE_ROWS) * stride_sn
        us_rows = s_ptr + expert * stride_se + ((inter + rows) // SCALE_ROWS) * stride_sn
        for k0 in range(0, hidden, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                g = tl.load(g_ptrs, mask=mask_n[:, None], other=0)
                u = tl.load(u_ptrs, mask=mask_n[:, None], other=0)
            else:
                mask_k = (k0 + offs_k) < hidden
                mask_w = mask_n[:, None] & ((k0 + offs_c * PER_ITEM) < hidden)[None, :]
                a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                g = tl.load(g_ptrs, mask=mask_w, other=0)
                u = tl.load(u_ptrs, mask=mask_w, other=0)
            if UPCAST:
                a = a.to(tl.float32)
            acc_gate = quantized_dot(
                a, g, gs_rows, k0, hidden, acc_gate, FORMAT, SCALE_COLS, BLOCK_K, SCALE_WEIGHTS
            )
            acc_up = quantized_dot(
                a, u, us_rows, k0, hidden, acc_up, FORMAT, SCALE_COLS, BLOCK_K, SCALE_WEIGHTS
            )
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K // PER_ITEM
            u_ptrs += BLOCK_K // PER_ITEM

    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    out_ptrs = out_ptr + slots.to(tl.int64)[:, None] * inter + offs_n[None, :]
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["numel"])
def _down_kernel(
    act_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    weights_ptr,
    sorted_ptr,
    block_expert_ptr,
    rows_used_ptr,
    numel,
    hidden,
    inter,
    stride_we,
    stride_wh,
    stride_se,
    stride_sh,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    FORMAT: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    PER_ITEM: tl.constexpr,
    SCALE_WEIGHTS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(rows_used_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = slots < numel
    slots64 = slots.to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + slots64[:, None] * inter + offs_k[None, :]
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wh + offs_k[:, None]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FORMAT == 0:
        for k0 in range(0, inter, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                mask_k = (k0 + offs_k) < inter
                a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=mask_n[None, :] & mask_k[:, None], other=0.0)
            acc = _dot(a, b, acc, UPCAST)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    else:  # as in the gate/up kernel: [BLOCK_N, stored items] tiles, scales per output row
        offs_c = tl.arange(0, BLOCK_K // PER_ITEM)
        b_ptrs = w_ptr + expert * stride_we + offs_n[:, None] * stride_wh + offs_c[None, :]
        rows = tl.minimum(offs_n, hidden - 1)
        s_rows = s_ptr + expert * stride_se + (rows // SCALE_ROWS) * stride_sh
        for k0 in range(0, inter, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=mask_n[:, None], other=0)
            else:
                mask_k = (k0 + offs_k) < inter
                mask_w = mask_n[:, None] & ((k0 + offs_c * PER_ITEM) < inter)[None, :]
                a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=mask_w, other=0)
            if UPCAST:
                a = a.to(tl.float32)
            acc = quantized_dot(
                a, b, s_rows, k0, inter, acc, FORMAT, SCALE_COLS, BLOCK_K, SCALE_WEIGHTS
            )
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K // PER_ITEM

    route_w = tl.load(weights_ptr + slots64, mask=mask_m, other=0.0).to(tl.float32)
    acc = acc * route_w[:, None]
    out_ptrs = out_ptr + slots64[:, None] * hidden + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# Per-GEMM tiles share BLOCK_M (the alignment's row block).
DEFAULT_CONFIG = {
    "BLOCK_M": 16,
    "gate_up": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
    "down": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
}


# Prefill-sized batches (many rows per expert): bigger tiles, tensor cores kept busy.
PREFILL_CONFIG = {
    "BLOCK_M": 64,
    "gate_up": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    "down": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
}


# Tuned entries from this many tokens up are prompt chunks' (engine.bench.prefill_moe): longer
# chunks inherit them, where a decode batch's entry says nothing about a chunk.
PREFILL_TUNED_MIN = 512


def _covers(table: dict, tokens: int) -> bool:
    """Whether a table's nearest entry speaks for `tokens`: a prompt chunk's entry for chunks
    from half its size up; a decode batch's for batches up to twice the largest one tuned (far
    past it, prefill tiles win)."""
    key = int(tuned.nearest_key(table, tokens))
    if key >= PREFILL_TUNED_MIN:
        return 2 * tokens >= key
    return tokens <= 2 * max(int(k) for k in table if int(k) < PREFILL_TUNED_MIN)


def table_name(weights: str, hidden: int, inter: int, experts: int, top_k: int) -> str:
    """The tuned table of this shape's expert-centric layer over weights of format `weights`
    (kernels.quant.format_name): `fused_moe_*` for bf16, `fused_moe_fp8_*` and so on."""
    family = "fused_moe" if weights == "bf16" else f"fused_moe_{weights}"
    return tuned.shape_name(family, hidden, inter, experts, top_k)


def default_config(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, weights: str = "bf16"
) -> dict:
    """Tuned tiles for this shape and batch: the weight format's own table
    (`fused_moe_fp8_*`, kernels.quant.format_name) where it covers the batch, else bf16's (the
    stages shrink BLOCK_K to fit the scales), else the defaults (prefill tiles for a batch that
    routes several rows to each expert)."""
    for fmt in dict.fromkeys((weights, "bf16")):
        table = (tuned.load(table_name(fmt, hidden, inter, experts, top_k)) or {}).get("configs")
        if table and _covers(table, tokens):
            return tuned.nearest(table, tokens)
    return PREFILL_CONFIG if tokens * top_k >= 8 * experts else DEFAULT_CONFIG


def _stages(cfg: dict) -> dict:
    # The interpreter ignores pipelining; keep launches cheap there.
    return {"num_warps": cfg["num_warps"], "num_stages": 1 if interpreting() else cfg["num_stages"]}


def fused_moe(
    x: torch.Tensor,
    w_gate_up: Weight,
    w_down: Weight,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: dict | None = None,
) -> torch.Tensor:
    """MoE layer, expert-centric; same contract as `kernels.warp_decode_moe`.

    x [T, H]; w_gate_up [E, 2I, H] gate rows first; w_down [E, H, I]; topk_ids [T, k] int;
    topk_weights [T, k] fp32. Returns y [T, H] in x's dtype. `config` overrides the tuned tiles.
    The weights are tensors in x's dtype or quantized (kernels.quant), read as stored.
    """
    x, w_gate_up, w_down, ids, route_w, n_tokens, hidden, inter, experts, top_k = moe_inputs(
        x, w_gate_up, w_down, topk_ids, topk_weights
    )
    if n_tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=x.device)

    cfg = config or default_config(n_tokens, hidden, inter, experts, top_k, format_name(w_down))
    grouping = align_by_expert(ids, experts, cfg["BLOCK_M"])
    act = gate_up_stage(x, w_gate_up, grouping, top_k, cfg["BLOCK_M"], cfg["gate_up"])
    per_slot = down_stage(act, w_down, route_w, grouping, cfg["BLOCK_M"], cfg["down"])
    if top_k == 1:
        return per_slot
    # The combine; torch sums bf16 in fp32 and rounds once.
    return per_slot.view(n_tokens, top_k, hidden).sum(dim=1)


def gate_up_stage(x, w_gate_up, grouping, top_k: int, block_m: int, cfg: dict) -> torch.Tensor:
    """Grouped GEMM 1 + SiLU*up: act [T*k, I] in x's dtype, one row per routed slot."""
    sorted_slots, block_expert, rows_used = grouping
    n_tokens, hidden = x.shape
    inter = w_gate_up.shape[1] // 2
    numel = n_tokens * top_k
    w = kernel_weight(w_gate_up)
    block_k = k_step(cfg["BLOCK_K"], w)
    act = torch.empty(numel, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(block_expert.numel(), triton.cdiv(inter, cfg["BLOCK_N"]))](
        x,
        w.stored,
        w.scale,
        act,
        sorted_slots,
        block_expert,
        rows_used,
        numel,
        hidden,
        inter,
        top_k,
        x.stride(0),
        w.stored.stride(0),
        w.stored.stride(1),
        w.scale.stride(0),
        w.scale.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=block_k,
        EVEN_K=hidden % block_k == 0,
        UPCAST=interpreting(),
        FORMAT=w.format,
        SCALE_ROWS=w.scale_rows,
        SCALE_COLS=w.scale_cols,
        PER_ITEM=w.per_item,
        SCALE_WEIGHTS=scale_weights(w, cfg.get("SCALE_WEIGHTS")),
        **_stages(cfg),
    )
    return act


def down_stage(act, w_down, route_w, grouping, block_m: int, cfg: dict) -> torch.Tensor:
    """Grouped GEMM 2, routing weight applied: per_slot [T*k, H] in act's dtype."""
    sorted_slots, block_expert, rows_used = grouping
    numel, inter = act.shape
    hidden = w_down.shape[1]
    w = kernel_weight(w_down)
    block_k = k_step(cfg["BLOCK_K"], w)
    per_slot = torch.empty(numel, hidden, dtype=act.dtype, device=act.device)
    _down_kernel[(block_expert.numel(), triton.cdiv(hidden, cfg["BLOCK_N"]))](
        act,
        w.stored,
        w.scale,
        per_slot,
        route_w,
        sorted_slots,
        block_expert,
        rows_used,
        numel,
        hidden,
        inter,
        w.stored.stride(0),
        w.stored.stride(1),
        w.scale.stride(0),
        w.scale.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=block_k,
        EVEN_K=inter % block_k == 0,
        UPCAST=interpreting(),
        FORMAT=w.format,
        SCALE_ROWS=w.scale_rows,
        SCALE_COLS=w.scale_cols,
        PER_ITEM=w.per_item,
        SCALE_WEIGHTS=scale_weights(w, cfg.get("SCALE_WEIGHTS")),
        **_stages(cfg),
    )
    return per_slot
