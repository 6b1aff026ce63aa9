"""Batched warp decode: output-centric, but each program holds every token of the batch.

Plain warp decode reads an expert's rows once per (token, slot) routed to it, so past a few
tokens it reads more than the expert-centric path. Here a weight row is read once for all the
tokens routed to it, still with no sort, pad, scatter or combine:

1. `_gate_up_kernel`, one program per (expert, block of intermediate neurons): finds the tokens
   routed to its expert by scanning topk_ids in registers (T <= 64), exits if none, and runs a
   [T, H] x [H, block] product for gate and up; writes silu(gate)*up into each routed slot's row.
2. `_down_kernel`, one program per block of hidden outputs: walks the experts, skips the ones
   no token picked, and for each adds weight * (act rows @ down rows) into an fp32 [T, block]
   accumulator; one write.

Same contract and numerics as `kernels.warp_decode.warp_decode_moe` (fp32 accumulation, routing
weights folded in fp32); meant for the larger decode batches (the dispatcher decides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import tuned
from kernels.fused_moe import _dot
from kernels.triton_env import interpreting, next_pow2

MAX_TOKENS = 64  # the token tile lives in registers


@triton.jit
def _routing_of(ids_tile, offs_k, expert, top_k):
    """For one expert: which tokens picked it (mask) and in which slot j."""
    match = ids_tile == expert
    routed = tl.max(match.to(tl.int32), axis=1) > 0
    slot_j = tl.sum(match.to(tl.int32) * offs_k[None, :], axis=1)
    return match, routed, slot_j


@triton.jit(do_not_specialize=["n_tokens"])
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    act_ptr,
    n_tokens,
    hidden,
    inter,
    top_k,
    stride_xt,
    stride_we,
    stride_wn,
    T_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr,
    UPCAST: tl.constexpr,
):
    expert = tl.program_id(0)
    pid_i = tl.program_id(1)
    offs_t = tl.arange(0, T_PAD)
    offs_k = tl.arange(0, K_PAD)
    ids_tile = tl.load(
        ids_ptr + offs_t[:, None] * top_k + offs_k[None, :],
        mask=(offs_t[:, None] < n_tokens) & (offs_k[None, :] < top_k),
        other=-1,
    )
    _, routed, slot_j = _routing_of(ids_tile, offs_k, expert, top_k)
    if tl.sum(routed.to(tl.int32), axis=0) == 0:
        return

    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < inter
    offs_h = tl.arange(0, BLOCK_H)
    a_ptrs = x_ptr + offs_t[:, None] * stride_xt + offs_h[None, :]
    g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_i[None, :] * stride_wn + offs_h[:, None]
    u_ptrs = g_ptrs + inter * stride_wn
    acc_gate = tl.zeros([T_PAD, BLOCK_I], dtype=tl.float32)
    acc_up = tl.zeros([T_PAD, BLOCK_I], dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        if EVEN_H:
            a = tl.load(a_ptrs, mask=routed[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=mask_i[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=mask_i[None, :], other=0.0)
        else:
            mask_h = (h0 + offs_h) < hidden
            a = tl.load(a_ptrs, mask=routed[:, None] & mask_h[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=mask_i[None, :] & mask_h[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=mask_i[None, :] & mask_h[:, None], other=0.0)
        acc_gate = _dot(a, g, acc_gate, UPCAST)
        acc_up = _dot(a, u, acc_up, UPCAST)
        a_ptrs += BLOCK_H
        g_ptrs += BLOCK_H
        u_ptrs += BLOCK_H

    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    slots = offs_t * top_k + slot_j
    tl.store(
        act_ptr + slots[:, None] * inter + offs_i[None, :],
        act.to(act_ptr.dtype.element_ty),
        mask=routed[:, None] & mask_i[None, :],
    )


@triton.jit(do_not_specialize=["n_tokens"])
def _down_kernel(
    act_ptr,
    w_ptr,
    ids_ptr,
    weights_ptr,
    y_ptr,
    n_tokens,
    hidden,
    inter,
    top_k,
    n_experts,
    stride_we,
    stride_wh,
    stride_yt,
    T_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_I: tl.constexpr,
    EVEN_I: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_h = tl.program_id(0)
    stride_we = stride_we.to(tl.int64)  # expert * stride can pass 2**31 at E=512
    offs_t = tl.arange(0, T_PAD)
    offs_k = tl.arange(0, K_PAD)
    tile_mask = (offs_t[:, None] < n_tokens) & (offs_k[None, :] < top_k)
    tile_offs = offs_t[:, None] * top_k + offs_k[None, :]
    ids_tile = tl.load(ids_ptr + tile_offs, mask=tile_mask, other=-1)
    w_tile = tl.load(weights_ptr + tile_offs, mask=tile_mask, other=0.0).to(tl.float32)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < hidden
    offs_i = tl.arange(0, BLOCK_I)
    acc = tl.zeros([T_PAD, BLOCK_H], dtype=tl.float32)
    for expert in range(0, n_experts):
        match, routed, slot_j = _routing_of(ids_tile, offs_k, expert, top_k)
        if tl.sum(routed.to(tl.int32), axis=0) > 0:
            route_w = tl.sum(tl.where(match, w_tile, 0.0), axis=1)
            slots = offs_t * top_k + slot_j
            a_ptrs = act_ptr + slots[:, None] * inter + offs_i[None, :]
            b_ptrs = w_ptr + expert * stride_we + offs_h[None, :] * stride_wh + offs_i[:, None]
            part = tl.zeros([T_PAD, BLOCK_H], dtype=tl.float32)
            for i0 in range(0, inter, BLOCK_I):
                if EVEN_I:
                    a = tl.load(a_ptrs, mask=routed[:, None], other=0.0)
                    b = tl.load(b_ptrs, mask=mask_h[None, :], other=0.0)
                else:
                    mask_i = (i0 + offs_i) < inter
                    a = tl.load(a_ptrs, mask=routed[:, None] & mask_i[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=mask_h[None, :] & mask_i[:, None], other=0.0)
                part = _dot(a, b, part, UPCAST)
                a_ptrs += BLOCK_I
                b_ptrs += BLOCK_I
            acc += part * route_w[:, None]  # routing weight folded in fp32

    tl.store(
        y_ptr + offs_t[:, None] * stride_yt + offs_h[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(offs_t[:, None] < n_tokens) & mask_h[None, :],
    )


DEFAULT_CONFIG = {
    "gate_up": {"BLOCK_I": 32, "BLOCK_H": 128, "num_warps": 4, "num_stages": 3},
    "down": {"BLOCK_H": 32, "BLOCK_I": 128, "num_warps": 4, "num_stages": 3},
}


def default_config(tokens: int, hidden: int, inter: int, experts: int, top_k: int) -> dict:
    table = tuned.load(tuned.shape_name("warp_decode_batched", hidden, inter, experts, top_k)) or {}
    return tuned.nearest(table.get("configs"), tokens) or DEFAULT_CONFIG


def _opts(cfg):
    return {"num_warps": cfg["num_warps"], "num_stages": 1 if interpreting() else cfg["num_stages"]}


def warp_decode_batched_moe(x, w_gate_up, w_down, topk_ids, topk_weights, config=None):
    """MoE layer, batched output-centric; same arguments and result as `warp_decode_moe`.

    Needs T <= 64 tokens (the token tile is held in registers) and distinct experts per token.
    """
    n_tokens, hidden = x.shape
    experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    assert n_tokens <= MAX_TOKENS, "batched warp decode holds at most 64 tokens"
    assert w_down.shape == (experts, hidden, inter), "w_down must be [E, H, I]"
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = topk_ids.contiguous()
    route_w = topk_weights.to(torch.float32).contiguous()
    cfg = config or default_config(n_tokens, hidden, inter, experts, top_k)
    t_pad, k_pad = max(16, next_pow2(n_tokens)), next_pow2(top_k)
    upcast = interpreting()

    act = torch.empty(n_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    g = cfg["gate_up"]
    _gate_up_kernel[(experts, triton.cdiv(inter, g["BLOCK_I"]))](
        x,
        w_gate_up,
        ids,
        act,
        n_tokens,
        hidden,
        inter,
        top_k,
        x.stride(0),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        T_PAD=t_pad,
        K_PAD=k_pad,
        BLOCK_I=g["BLOCK_I"],
        BLOCK_H=g["BLOCK_H"],
        EVEN_H=hidden % g["BLOCK_H"] == 0,
        UPCAST=upcast,
        **_opts(g),
    )
    y = torch.empty(n_tokens, hidden, dtype=x.dtype, device=x.device)
    d = cfg["down"]
    _down_kernel[(triton.cdiv(hidden, d["BLOCK_H"]),)](
        act,
        w_down,
        ids,
        route_w,
        y,
        n_tokens,
        hidden,
        inter,
        top_k,
        experts,
        w_down.stride(0),
        w_down.stride(1),
        y.stride(0),
        T_PAD=t_pad,
        K_PAD=k_pad,
        BLOCK_H=d["BLOCK_H"],
        BLOCK_I=d["BLOCK_I"],
        EVEN_I=inter % d["BLOCK_I"] == 0,
        UPCAST=upcast,
        **_opts(d),
    )
    return y
