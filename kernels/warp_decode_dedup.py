"""Warp decode that reads each routed expert's gate/up rows once per batch, not once per slot.

Plain warp decode (`kernels.warp_decode`) gives every (token, slot) its own pass over the
expert's rows, so an expert picked by three tokens is streamed three times (L2 catches some
of it). Here kernel 1 keeps warp decode's grid, one program per (slot, block of intermediate
neurons), but a program whose expert already appears at an earlier slot exits at once; the
first slot's program streams the rows and applies them to every token routed to that expert,
GROUP tokens per pass (fp32 accumulators [GROUP, BLOCK_I, BLOCK_H]), writing each of those
slots' silu(gate)*up. No sort, pad or scatter: the duplicate test is a compare over the T*k
ids held in registers, and the grid does not depend on the routing (CUDA-graph safe).

Kernel 2 is warp decode's down kernel unchanged (per token and block of hidden outputs, fp32
accumulation over the token's experts, one write), including its overlap with kernel 1.
Same contract and numerics as `kernels.warp_decode.warp_decode_moe`. On the H200 at the
Qwen3-30B-A3B shape it measured slower than plain warp decode at every batch size (see
BENCHMARKS.md); it stays a path the dispatcher's measured table can choose.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import tuned
from kernels import warp_decode as wd
from kernels.moe_inputs import moe_inputs
from kernels.triton_env import next_pow2

MAX_SLOTS = 1024  # T*k ids held in registers by every program


@triton.jit(do_not_specialize=["n_tokens"])
def _gate_up_dedup_kernel(
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
    S_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr,
    LAUNCH_DEPS: tl.constexpr,
):
    if LAUNCH_DEPS:  # kernel 2 may be scheduled once every program here has started
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.program_id(0)
    pid_i = tl.program_id(1)
    expert = tl.load(ids_ptr + slot)
    offs_s = tl.arange(0, S_PAD)
    earlier = tl.load(ids_ptr + offs_s, mask=offs_s < slot, other=-1)
    if tl.sum((earlier == expert).to(tl.int32), axis=0) > 0:
        return  # the expert's first slot serves every token routed to it

    # Tokens routed to this expert, their slot j, and their rank among them.
    offs_t = tl.arange(0, T_PAD)
    offs_k = tl.arange(0, K_PAD)
    ids_tile = tl.load(
        ids_ptr + offs_t[:, None] * top_k + offs_k[None, :],
        mask=(offs_t[:, None] < n_tokens) & (offs_k[None, :] < top_k),
        other=-1,
    )
    match = (ids_tile == expert).to(tl.int32)
    routed = tl.sum(match, axis=1)  # 0 or 1: a token picks an expert at most once
    slot_j = tl.sum(match * offs_k[None, :], axis=1)
    rank = tl.cumsum(routed, axis=0) - 1
    n_routed = tl.sum(routed, axis=0)

    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < inter
    offs_h = tl.arange(0, BLOCK_H)
    offs_g = tl.arange(0, GROUP)
    w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_i[:, None] * stride_wn + offs_h[None, :]
    for g0 in range(0, n_routed, GROUP):
        # The GROUP routed tokens of this pass, picked out of the token tile by rank.
        pick = (routed[None, :] > 0) & (rank[None, :] == g0 + offs_g[:, None])  # [GROUP, T_PAD]
        tok = tl.sum(tl.where(pick, offs_t[None, :], 0), axis=1)
        tok_j = tl.sum(tl.where(pick, slot_j[None, :], 0), axis=1)
        valid = (g0 + offs_g) < n_routed

        gate_ptrs = w_base
        up_ptrs = w_base + inter * stride_wn
        x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_h[None, :]
        acc_gate = tl.zeros([GROUP, BLOCK_I, BLOCK_H], dtype=tl.float32)
        acc_up = tl.zeros([GROUP, BLOCK_I, BLOCK_H], dtype=tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            if EVEN_H:
                xv = tl.load(x_ptrs, mask=valid[:, None], other=0.0).to(tl.float32)
                gate = tl.load(gate_ptrs, mask=mask_i[:, None], other=0.0).to(tl.float32)
                up = tl.load(up_ptrs, mask=mask_i[:, None], other=0.0).to(tl.float32)
            else:
                mask_h = (h0 + offs_h) < hidden
                mask_w = mask_i[:, None] & mask_h[None, :]
                xv = tl.load(x_ptrs, mask=valid[:, None] & mask_h[None, :], other=0.0).to(
                    tl.float32
                )
                gate = tl.load(gate_ptrs, mask=mask_w, other=0.0).to(tl.float32)
                up = tl.load(up_ptrs, mask=mask_w, other=0.0).to(tl.float32)
            acc_gate += gate[None, :, :] * xv[:, None, :]
            acc_up += up[None, :, :] * xv[:, None, :]
            x_ptrs += BLOCK_H
            gate_ptrs += BLOCK_H
            up_ptrs += BLOCK_H

        gate_sum = tl.sum(acc_gate, axis=2)
        up_sum = tl.sum(acc_up, axis=2)
        act = gate_sum / (1.0 + tl.exp(-gate_sum)) * up_sum
        rows = tok * top_k + tok_j
        tl.store(
            act_ptr + rows[:, None] * inter + offs_i[None, :],
            act.to(act_ptr.dtype.element_ty),
            mask=valid[:, None] & mask_i[None, :],
        )


DEFAULT_GATE_UP = {"BLOCK_I": 2, "BLOCK_H": 512, "GROUP": 2, "num_warps": 4}


def default_configs(tokens: int, hidden: int, inter: int, experts: int, top_k: int) -> dict:
    """Tuned configs for this shape and batch if the repo has them, else the defaults
    (kernel 2 falls back to warp decode's tuned down config)."""
    table = tuned.load(tuned.shape_name("warp_decode_dedup", hidden, inter, experts, top_k)) or {}
    return {
        "gate_up": tuned.nearest(table.get("gate_up"), tokens) or DEFAULT_GATE_UP,
        "down": tuned.nearest(table.get("down"), tokens)
        or wd.default_configs(tokens, hidden, inter, experts, top_k)["down"],
    }


def gate_up_dedup(x, w_gate_up, ids, cfg: dict, launch_deps: bool = False) -> torch.Tensor:
    """Kernel 1: act [T*k, I] = silu(gate) * up of each routed slot, each expert read once."""
    n_tokens, hidden = x.shape
    inter = w_gate_up.shape[1] // 2
    top_k = ids.shape[1]
    assert n_tokens * top_k <= MAX_SLOTS, "deduplicated warp decode holds at most 1024 slots"
    act = torch.empty(n_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    block_i = wd._fit(cfg["BLOCK_I"], inter)
    block_h = wd._fit(cfg["BLOCK_H"], hidden)
    _gate_up_dedup_kernel[(n_tokens * top_k, triton.cdiv(inter, block_i))](
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
        T_PAD=next_pow2(n_tokens),
        K_PAD=next_pow2(top_k),
        S_PAD=next_pow2(n_tokens * top_k),
        GROUP=cfg["GROUP"],
        BLOCK_I=block_i,
        BLOCK_H=block_h,
        EVEN_H=hidden % block_h == 0,
        LAUNCH_DEPS=launch_deps,
        **wd._launch_opts(cfg),
    )
    return act


def warp_decode_dedup_moe(x, w_gate_up, w_down, topk_ids, topk_weights, config=None):
    """MoE layer; same arguments, result and numerics as `kernels.warp_decode.warp_decode_moe`.

    Needs T*k <= 1024 and distinct experts within a token (as top-k gives).
    `config` ({"gate_up": {...}, "down": {...}}) overrides the tuned block sizes.
    """
    x, w_gate_up, w_down, ids, route_w, n_tokens, hidden, inter, experts, top_k = moe_inputs(
        x, w_gate_up, w_down, topk_ids, topk_weights
    )
    if n_tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=x.device)

    cfg = config or default_configs(n_tokens, hidden, inter, experts, top_k)
    pdl = wd.use_pdl(cfg["down"], x.device)
    act = gate_up_dedup(x, w_gate_up, ids, cfg["gate_up"], launch_deps=pdl)
    return wd.down(act, w_down, ids, route_w, cfg["down"])
