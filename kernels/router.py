"""Fused router: softmax -> top-k -> optional renormalise, one program per token.

The logits come from one GEMM (`F.linear` in the activation dtype, as Hugging Face's Qwen3-MoE
computes them), so the kernel sees exactly the reference's logits; everything after is fp32.
Top-k is k rounds of arg-max over the row held in registers (E <= 512, k <= 16); ties go to the
lower expert index.

`norm_route` is the decode step's routing in one launch: residual add, RMSNorm, the router's
logits and the softmax/top-k above. A row's experts are split over several programs (the router
weight read spreads over SMs even at one token); the last program of a row to finish does the
softmax/top-k over the row's logits (the "last program" pattern: no second launch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import launch_dependents, launch_options, pdl_supported, wait
from kernels.triton_env import next_pow2


@triton.jit
def _softmax_topk_store(
    logits,
    mask_e,
    ids_ptr,
    weights_ptr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Softmax of one row's fp32 logits [E_PAD] (-inf where ~mask_e), top-k by repeated arg-max
    (ties to the lower index), optional renormalise; stores TOP_K ids (int64) and weights (fp32)
    at ids_ptr / weights_ptr (the row's first slot)."""
    offs_e = tl.arange(0, E_PAD)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    probs = tl.where(mask_e, probs, -1.0)  # padding lanes never win

    offs_k = tl.arange(0, K_PAD)
    top_ids = tl.zeros([K_PAD], dtype=tl.int64)
    top_w = tl.zeros([K_PAD], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        best_id = tl.min(tl.where(probs == best, offs_e, E_PAD), axis=0)
        top_ids = tl.where(offs_k == j, best_id.to(tl.int64), top_ids)
        top_w = tl.where(offs_k == j, best, top_w)
        probs = tl.where(offs_e == best_id, -1.0, probs)

    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    mask_k = offs_k < TOP_K
    tl.store(ids_ptr + offs_k, top_ids, mask=mask_k)
    tl.store(weights_ptr + offs_k, top_w, mask=mask_k)


@triton.jit(do_not_specialize=["n_tokens"])
def _softmax_topk_kernel(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    n_tokens,
    n_experts,
    stride_lt,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    token = tl.program_id(0)
    offs_e = tl.arange(0, E_PAD)
    mask_e = offs_e < n_experts
    logits = tl.load(logits_ptr + token * stride_lt + offs_e, mask=mask_e, other=float("-inf"))
    _softmax_topk_store(
        logits.to(tl.float32),
        mask_e,
        ids_ptr + token * TOP_K,
        weights_ptr + token * TOP_K,
        TOP_K,
        K_PAD,
        E_PAD,
        RENORMALIZE,
    )


def softmax_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """logits [T, E] (any float dtype) -> (ids int64 [T, k], weights fp32 [T, k])."""
    n_tokens, n_experts = logits.shape
    assert 0 < top_k <= n_experts
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    ids = torch.empty(n_tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(n_tokens, top_k, dtype=torch.float32, device=logits.device)
    if n_tokens == 0:
        return ids, weights
    _softmax_topk_kernel[(n_tokens,)](
        logits,
        ids,
        weights,
        n_tokens,
        n_experts,
        logits.stride(0),
        TOP_K=top_k,
        K_PAD=next_pow2(top_k),
        E_PAD=next_pow2(n_experts),
        RENORMALIZE=norm_topk_prob,
        num_warps=4 if n_experts > 128 else 1,
    )
    return ids, weights


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """Router of a MoE layer: (topk_ids int64 [T, k], topk_weights fp32 [T, k]).

    Same contract as `kernels.reference.route`: logits = x @ router_weight.T in x's dtype,
    softmax in fp32, top-k, renormalised when `norm_topk_prob`.
    """
    return softmax_topk(F.linear(x, router_weight), top_k, norm_topk_prob)


@triton.jit
def _norm_route_kernel(
    x_ptr,
    delta_ptr,
    norm_w_ptr,
    router_ptr,
    sum_ptr,
    h_ptr,
    logits_ptr,
    counters_ptr,
    ids_ptr,
    weights_ptr,
    hidden,
    n_experts,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < hidden
    offs_e = block * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_e = offs_e < n_experts
    # Weights first: no earlier kernel of the step writes them, so their read overlaps its tail.
    router = tl.load(
        router_ptr + offs_e[:, None].to(tl.int64) * hidden + offs_h[None, :],
        mask=mask_e[:, None] & mask_h[None, :],
        other=0.0,
    )
    norm_w = tl.load(norm_w_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    wait(PDL)

    # s and h exactly as `kernels.fused_ops._add_rms_norm_kernel` computes them.
    act = h_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * hidden + offs_h, mask=mask_h, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * hidden + offs_h, mask=mask_h, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(act)  # rounded as torch's x + delta
    x = x.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = normed.to(act).to(tl.float32)  # cast back before the weight, as the reference
    h = (norm_w * normed).to(act)
    if block == 0:
        if HAS_DELTA:
            tl.store(sum_ptr + row * hidden + offs_h, x.to(act), mask=mask_h)
        tl.store(h_ptr + row * hidden + offs_h, h, mask=mask_h)

    # This program's logits: fp32 sums rounded to the activation dtype, as F.linear's output is.
    logits = tl.sum(router.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
    logits = logits.to(act).to(tl.float32)
    tl.store(logits_ptr + row * n_experts + offs_e, logits, mask=mask_e)

    # The row's last program to finish holds every logit of the row: softmax and top-k there.
    tl.debug_barrier()  # every thread's logits stored before the count says so
    count = tl.atomic_add(counters_ptr + row, 1, sem="acq_rel")
    if count == tl.num_programs(1) - 1:
        offs_all = tl.arange(0, E_PAD)
        mask_all = offs_all < n_experts
        row_logits = tl.load(
            logits_ptr + row * n_experts + offs_all,
            mask=mask_all,
            other=float("-inf"),
            cache_modifier=".cg",  # from L2: another SM wrote them
        )
        _softmax_topk_store(
            row_logits,
            mask_all,
            ids_ptr + row * TOP_K,
            weights_ptr + row * TOP_K,
            TOP_K,
            K_PAD,
            E_PAD,
            RENORMALIZE,
        )
        tl.store(counters_ptr + row, 0)  # ready for the next call and every graph replay


# A program's router tile: this many weights, held in registers (a few tens of KB in bf16).
TILE_ELEMS = 16384


def default_block_e(n_experts: int, hidden: int) -> int:
    """Experts per program: as many as fit the tile beside the whole hidden row (power of two)."""
    return max(1, min(next_pow2(n_experts), TILE_ELEMS // next_pow2(hidden)))


def norm_route(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    router_weight: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    counters: torch.Tensor | None = None,
    pdl: bool = False,
    block_e: int | None = None,
):
    """Residual add, RMSNorm and routing in one launch: (s, h, topk_ids, topk_weights).

    x, delta [T, H] (delta None: s = x, returned as is); norm_weight [H]; router_weight [E, H].
    s = x + delta and h = rms_norm(s) * norm_weight as `kernels.fused_ops.add_rms_norm` gives
    them ([T, H], x's dtype); topk_ids int64 [T, k] and topk_weights fp32 [T, k] as `route(h,
    router_weight, ...)` gives them, up to the logits' summation order (fp32 sums rounded to x's
    dtype). `counters`: int32, at least T elements, all 0 (the call leaves them 0); None
    allocates them. `block_e`: experts per program, a power of two (default `default_block_e`).
    """
    tokens, hidden = x.shape
    n_experts = router_weight.shape[0]
    assert router_weight.shape == (n_experts, hidden) and norm_weight.shape == (hidden,)
    assert 0 < top_k <= n_experts
    x = x.contiguous()
    router_weight = router_weight.contiguous()
    s = torch.empty_like(x) if delta is not None else x
    h = torch.empty_like(x)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return s, h, ids, weights
    if counters is None:
        counters = torch.zeros(tokens, dtype=torch.int32, device=x.device)
    assert counters.dtype == torch.int32 and counters.numel() >= tokens
    block_e = block_e or default_block_e(n_experts, hidden)
    assert block_e == next_pow2(block_e), "block_e must be a power of two"
    logits = torch.empty(tokens, n_experts, dtype=torch.float32, device=x.device)
    block_h = next_pow2(hidden)
    pdl = pdl and pdl_supported(x.device)
    _norm_route_kernel[(tokens, triton.cdiv(n_experts, block_e))](
        x,
        delta.contiguous() if delta is not None else x,
        norm_weight,
        router_weight,
        s,
        h,
        logits,
        counters,
        ids,
        weights,
        hidden,
        n_experts,
        eps,
        HAS_DELTA=delta is not None,
        BLOCK_H=block_h,
        BLOCK_E=block_e,
        TOP_K=top_k,
        K_PAD=next_pow2(top_k),
        E_PAD=next_pow2(n_experts),
        RENORMALIZE=norm_topk_prob,
        PDL=pdl,
        num_warps=max(1, min(8, block_e * block_h // 2048)),
        **launch_options(pdl),
    )
    return s, h, ids, weights
