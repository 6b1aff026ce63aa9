"""Shared by the kernel tests: random MoE layers with weights quantized by the project's own
quantizers, and outputs poisoned so that an element a kernel fails to write cannot pass."""

from __future__ import annotations

import torch

from engine.loading import fp8, int4
from kernels import reference


def poison_torch_empty(monkeypatch) -> None:
    """Every torch.empty starts as NaN (ints: a large sentinel)."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        t.fill_(float("nan") if t.is_floating_point() else 2**30)
        return t

    monkeypatch.setattr(torch, "empty", poisoned)


def quantize(w: torch.Tensor, fmt: str, size: int):
    """FP8 in blocks of size x size, or int4 in groups of size."""
    return fp8.quantized_weight(w, size) if fmt == "fp8" else int4.quantized_weight(w, size)


def quantized_moe_layer(tokens, hidden, inter, experts, top_k, fmt, size, seed):
    """(x, w_gate_up, w_down, ids, weights) with the two expert weights quantized."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    router = torch.randn(experts, hidden, generator=gen).bfloat16()
    ids, weights = reference.route(x, router, top_k, norm_topk_prob=True)
    return x, quantize(gate_up, fmt, size), quantize(down, fmt, size), ids, weights
