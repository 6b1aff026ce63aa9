"""Compute kernels: torch references (CPU path and test oracle) and Triton kernels for CUDA."""

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

__all__ = [
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
