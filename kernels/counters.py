"""Device-side counters that kernels leave at zero, one buffer per device and user.

Kernels that coordinate their programs through atomics (the split-K GEMV's arrival counts, the
persistent MoE kernel's tickets) reset their counters before they finish, so one zeroed buffer
serves every launch and every replay of a captured CUDA graph. The buffer is per device, not per
stream: two such launches of one user running at once on different streams would share it.
"""

from __future__ import annotations

import functools

import torch

_BUFFERS: dict[tuple[torch.device, str], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def zeroed_counters(device: torch.device, needed: int, user: str) -> torch.Tensor:
    """At least `needed` int32 counters, zero between launches, for `user`'s kernels alone.
    Grown outside a CUDA graph's capture: the step's warm-up runs first."""
    counters = _BUFFERS.get((device, user))
    if counters is None or counters.numel() < needed:
        if counters is not None:  # a graph captured earlier keeps its address: kept alive
            _OUTGROWN.append(counters)
        counters = torch.zeros(max(needed, 1024), dtype=torch.int32, device=device)
        _BUFFERS[device, user] = counters
    return counters


def counters_of(device: torch.device, user: str) -> torch.Tensor | None:
    """`user`'s buffer on `device`, if it has one (tests check it is left at zero)."""
    return _BUFFERS.get((device, user))


@functools.cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
