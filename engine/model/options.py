"""How a model computes, chosen at load and fixed for the model's life: `ModelOptions`.

A model built with other options shares the weights (`Qwen3MoeModel.with_options`), so a test or
benchmark that compares paths holds one model per path instead of switching one model back and
forth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model import lean_matrices

MOE_PATHS = ("auto", "expert_centric", "output_centric")

# The MoE function's arguments: x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], topk_ids and
# topk_weights [T, k], as `kernels.reference.moe_*` take them; it returns [T, H].
MoeFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


@dataclass(frozen=True)
class ModelOptions:
    # "auto": the model picks each MoE layer's path (by the routed pairs on the CPU, the Triton
    # dispatcher on CUDA); the others force the torch reference's path for every layer.
    moe_path: str = "auto"
    # False: the CPU's small-batch steps run the general path too (for comparisons).
    lean_decode: bool = True
    # The lean CPU path's weights (engine.model.lean_matrices). "auto": a form that holds the
    # model's weights exactly: int4 for a model trained through int4 groups (an eighth of fp32's
    # bytes; activations rounded to bf16, as the model was trained; the lm_head int8 with the
    # logits near the best in fp32), else fp32. "int8" streams a quarter of the bytes but rounds
    # the weights, which changes some greedy completions.
    lean_weights: str = "auto"
    # The int4 form only: a step that is not decisive (a routing near-tie, two close best logits)
    # is computed again from the fp32 weights, so greedy answers follow the fp32 general path
    # closer still, at the cost of those steps (engine.model.lean_cpu).
    lean_guard: bool = False
    # Replaces every MoE layer's path when set: the local-experts MoE of expert parallelism
    # (engine.model.expert_parallel), whose layers hold only their rank's experts, or a kernel.
    moe_fn: MoeFn | None = None

    def __post_init__(self):
        if self.moe_path not in MOE_PATHS:
            raise ValueError(f"moe_path is one of {MOE_PATHS}, not {self.moe_path!r}")
        if self.lean_weights not in ("auto", *lean_matrices.FORMS):
            raise ValueError(
                f"lean_weights is auto or one of {lean_matrices.FORMS}, not {self.lean_weights!r}"
            )
