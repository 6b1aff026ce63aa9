"""Small decode-step ops fused into one launch each (Triton, CUDA).

At batch 1 a decode step is launch-bound: the torch reference spends ~20 tiny kernels per layer
on residual adds, RMSNorms, q/k norms, RoPE and the KV write. Two kernels replace them:

- `add_rms_norm`: residual add, then RMSNorm of the sum (one read of each input, two writes);
- `AttentionHeads.store`: per-head RMSNorm of q and k, RoPE, and the store of k and v into the
  KV pool's slots, straight from the fused qkv projection (`AttentionHeads` says where they go;
  kernels.gemv.heads_linear runs the same as the projection's epilogue).

Numerics follow `kernels.reference` (and transformers): the sum and each norm's output are
rounded to the activation dtype where the reference rounds them; statistics are fp32.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_dependents, launch_options, pdl_supported, wait
from kernels.triton_env import next_pow2


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    delta_ptr,
    w_ptr,
    sum_ptr,
    out_ptr,
    hidden,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: no wait for it
    wait(PDL)  # x and delta are the step's earlier outputs
    x = tl.load(x_ptr + row * hidden + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        # The residual stream is rounded to its dtype after the add, as x + delta does in torch.
        x = x.to(tl.float32) + tl.load(delta_ptr + row * hidden + offs, mask=mask, other=0.0).to(
            tl.float32
        )
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * hidden + offs, x, mask=mask)
    x = x.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)  # cast back before the weight
    tl.store(out_ptr + row * hidden + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    pdl: bool = False,
):
    """(s, rms_norm(s)) with s = x + delta (s = x when delta is None); x, delta [T, H].
    `pdl`: launched as a link of a PDL chain (kernels.pdl)."""
    tokens, hidden = x.shape
    pdl = pdl and pdl_supported(x.device)
    x = x.contiguous()
    total = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x)
    block = next_pow2(hidden)
    _add_rms_norm_kernel[(tokens,)](
        x,
        delta.contiguous() if delta is not None else x,
        weight,
        total,
        out,
        hidden,
        eps,
        HAS_DELTA=delta is not None,
        BLOCK=block,
        PDL=pdl,
        num_warps=max(1, min(8, block // 256)),
        **launch_options(pdl),
    )
    return total, out


@triton.jit
def head_norm_rope_store(
    lo,
    hi,
    head,
    tokens,
    token_ok,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_dst_ptr,
    v_dst_ptr,
    slots_ptr,
    stride_cs,
    stride_dst_slot,
    n_q_heads,
    n_kv_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
):
    """One head of the fused q/k/v projection for the tokens at `tokens` [R] (those with
    `token_ok`): its halves lo, hi [R, HALF] (fp32 of values in the activation dtype) normed
    and rotated into q_out (q heads), normed, rotated and stored at each token's slot (k heads),
    or stored there as they are (v heads). Shared by `AttentionHeads.store` and the q/k/v GEMV's
    epilogue (kernels.gemv.heads_linear), which must round alike."""
    d = tl.arange(0, HALF)
    ok = token_ok[:, None]
    slot = tl.load(slots_ptr + tokens, mask=token_ok, other=0).to(tl.int64)
    if head >= n_q_heads + n_kv_heads:  # v: stored as it is
        dst = (
            v_dst_ptr + slot[:, None] * stride_dst_slot + (head - n_q_heads - n_kv_heads) * HEAD_DIM
        )
        tl.store(dst + d[None, :], lo.to(v_dst_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF + d[None, :], hi.to(v_dst_ptr.dtype.element_ty), mask=ok)
    else:
        out_dtype = q_out_ptr.dtype.element_ty
        is_q = head < n_q_heads
        if is_q:
            w_lo = tl.load(qw_ptr + d).to(tl.float32)[None, :]
            w_hi = tl.load(qw_ptr + HALF + d).to(tl.float32)[None, :]
        else:
            w_lo = tl.load(kw_ptr + d).to(tl.float32)[None, :]
            w_hi = tl.load(kw_ptr + HALF + d).to(tl.float32)[None, :]
        inv = tl.rsqrt((tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)) / HEAD_DIM + eps)
        inv = inv[:, None]
        lo = (w_lo * (lo * inv).to(out_dtype).to(tl.float32)).to(out_dtype).to(tl.float32)
        hi = (w_hi * (hi * inv).to(out_dtype).to(tl.float32)).to(out_dtype).to(tl.float32)
        # Rotate-half RoPE, each product rounded as the reference's x*cos + rot(x)*sin is.
        cs = cos_ptr + tokens[:, None] * stride_cs + d[None, :]
        sn = sin_ptr + tokens[:, None] * stride_cs + d[None, :]
        cos_lo = tl.load(cs, mask=ok, other=0.0).to(tl.float32)
        cos_hi = tl.load(cs + HALF, mask=ok, other=0.0).to(tl.float32)
        sin_lo = tl.load(sn, mask=ok, other=0.0).to(tl.float32)
        sin_hi = tl.load(sn + HALF, mask=ok, other=0.0).to(tl.float32)
        r_lo = (lo * cos_lo).to(out_dtype).to(tl.float32) + (-hi * sin_lo).to(out_dtype).to(
            tl.float32
        )
        r_hi = (hi * cos_hi).to(out_dtype).to(tl.float32) + (lo * sin_hi).to(out_dtype).to(
            tl.float32
        )
        if is_q:
            q_dst = q_out_ptr + (tokens[:, None] * n_q_heads + head) * HEAD_DIM + d[None, :]
            tl.store(q_dst, r_lo.to(out_dtype), mask=ok)
            tl.store(q_dst + HALF, r_hi.to(out_dtype), mask=ok)
        else:
            k_dst = k_dst_ptr + slot[:, None] * stride_dst_slot + (head - n_q_heads) * HEAD_DIM
            tl.store(k_dst + d[None, :], r_lo.to(k_dst_ptr.dtype.element_ty), mask=ok)
            tl.store(k_dst + HALF + d[None, :], r_hi.to(k_dst_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_dst_ptr,
    v_dst_ptr,
    slots_ptr,
    stride_qkv,
    stride_cs,
    stride_dst_slot,
    n_q_heads,
    n_kv_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    launch_dependents(PDL)
    wait(PDL)  # everything here reads the projection just written
    tokens = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # this program's one token
    head = tl.program_id(1)  # q heads, then k heads, then v heads, as they sit in qkv
    d = tl.arange(0, HALF)
    src = qkv_ptr + tokens[:, None] * stride_qkv + head * HEAD_DIM + d[None, :]
    lo = tl.load(src).to(tl.float32)
    hi = tl.load(src + HALF).to(tl.float32)
    head_norm_rope_store(
        lo,
        hi,
        head,
        tokens,
        tokens >= 0,  # every token of the one-token tile is real
        qw_ptr,
        kw_ptr,
        cos_ptr,
        sin_ptr,
        q_out_ptr,
        k_dst_ptr,
        v_dst_ptr,
        slots_ptr,
        stride_cs,
        stride_dst_slot,
        n_q_heads,
        n_kv_heads,
        eps,
        HEAD_DIM,
        HALF,
    )


@dataclasses.dataclass(frozen=True)
class AttentionHeads:
    """Where the heads of T decode tokens' fused q/k/v projection go: q normed by q_norm [D]
    and rotated into a new [T, Hq, D] tensor; k normed by k_norm, rotated and stored, and v
    stored, at `slots` [T] of key_dst / value_dst [slots, Hkv, D] (the KV pool's layer, or a
    scratch). cos, sin [T, D]: the rotate-half tables in the activation dtype."""

    q_norm: torch.Tensor
    k_norm: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    key_dst: torch.Tensor
    value_dst: torch.Tensor
    slots: torch.Tensor
    n_q_heads: int
    n_kv_heads: int
    eps: float

    @property
    def head_dim(self) -> int:
        return self.q_norm.shape[0]

    def kernel_args(self, qkv_shape, dtype) -> tuple[torch.Tensor, tuple, tuple]:
        """(q, pointers, scalars) for a kernel that runs `head_norm_rope_store` on a projection
        of `qkv_shape` [T, (Hq + 2*Hkv) * D]: the new q [T, Hq, D] in `dtype`, then the
        pointers (q_norm, k_norm, cos, sin, q, key_dst, value_dst, slots) and the scalars
        (cos's row stride, the destinations' slot stride, Hq, Hkv) in the kernels' order."""
        tokens, width = qkv_shape
        head_dim = self.head_dim
        assert next_pow2(head_dim) == head_dim and head_dim >= 2, "head_dim: a power of two"
        assert width == (self.n_q_heads + 2 * self.n_kv_heads) * head_dim
        assert self.slots.shape[0] >= tokens
        assert self.cos.shape[0] >= tokens and self.cos.shape[-1] == head_dim
        assert self.key_dst.shape[1:] == (self.n_kv_heads, head_dim)
        assert self.key_dst.stride()[1:] == (head_dim, 1)
        assert self.key_dst.stride() == self.value_dst.stride()
        q = torch.empty(tokens, self.n_q_heads, head_dim, dtype=dtype, device=self.q_norm.device)
        cos, sin = self.cos.contiguous(), self.sin.contiguous()
        pointers = (self.q_norm, self.k_norm, cos, sin, q, self.key_dst, self.value_dst)
        pointers += (self.slots,)
        scalars = (cos.stride(0), self.key_dst.stride(0), self.n_q_heads, self.n_kv_heads)
        return q, pointers, scalars

    def store(self, qkv: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """q [T, Hq, D] from the projection qkv [T, (Hq + 2*Hkv) * D], normed and rotated, with
        k and v stored, in one launch. `pdl`: a link of a PDL chain (kernels.pdl)."""
        q, pointers, scalars = self.kernel_args(qkv.shape, qkv.dtype)
        pdl = pdl and pdl_supported(qkv.device)
        _qk_norm_rope_store_kernel[(qkv.shape[0], self.n_q_heads + 2 * self.n_kv_heads)](
            qkv,
            *pointers,
            qkv.stride(0),
            *scalars,
            self.eps,
            HEAD_DIM=self.head_dim,
            HALF=self.head_dim // 2,
            PDL=pdl,
            num_warps=1,
            **launch_options(pdl),
        )
        return q
