"""Fused router: softmax -> top-k -> optional renormalise, one program per token.

The logits come from one GEMM (`F.linear` in the activation dtype, as Hugging Face's Qwen3-MoE
computes them), so the kernel sees exactly the reference's logits; everything after is fp32.
Top-k is k rounds of arg-max over the row held in registers (E <= 512, k <= 16); ties go to the
lower expert index.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.triton_env import next_pow2


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
    logits = logits.to(tl.float32)
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
    tl.store(ids_ptr + token * TOP_K + offs_k, top_ids, mask=mask_k)
    tl.store(weights_ptr + token * TOP_K + offs_k, top_w, mask=mask_k)


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
