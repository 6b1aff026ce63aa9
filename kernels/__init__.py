"""Compute kernels: torch references (CPU path and test oracle) and Triton kernels for CUDA.

The engine calls `kernels.dispatch.moe` / `kernels.dispatch.route`, which pick Triton on CUDA
tensors and the references on CPU tensors. The Triton-backed names below (`warp_decode_moe`,
`expert_centric_moe`, `softmax_topk`) import Triton on first use, so `import kernels` stays
light. (`kernels.fused_moe` is the module of the expert-centric path, hence the other name.)
"""

from kernels import dispatch
from kernels.reference import (
    apply_rope,
    attention,
    dense_mlp,
    moe_expert_centric,
    moe_float64,
    moe_output_centric,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    route,
)

# exported name -> (module, name there); loaded on first attribute access (PEP 562).
_TRITON_EXPORTS = {
    "warp_decode_moe": ("kernels.warp_decode", "warp_decode_moe"),
    "warp_decode_batched_moe": ("kernels.warp_decode_batched", "warp_decode_batched_moe"),
    "expert_centric_moe": ("kernels.fused_moe", "fused_moe"),
    "softmax_topk": ("kernels.router", "softmax_topk"),
}


def __getattr__(name: str):
    if name in _TRITON_EXPORTS:
        import importlib

        module, attr = _TRITON_EXPORTS[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")


__all__ = [
    "dispatch",
    "expert_centric_moe",
    "softmax_topk",
    "warp_decode_batched_moe",
    "warp_decode_moe",
    "apply_rope",
    "attention",
    "dense_mlp",
    "moe_expert_centric",
    "moe_float64",
    "moe_output_centric",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
    "route",
]
