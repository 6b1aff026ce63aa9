"""Programmatic dependent launch (PDL): a kernel in a chain starts while its predecessor drains.

The decode step is a chain of short kernels; between two of them the GPU idles for the launch
and the ramp of the second. With PDL (Hopper and later) kernel N+1 is launched with
`launch_pdl=True`, kernel N calls `gdc_launch_dependents()` so N+1's programs may be scheduled
once every program of N has started, and N+1 does what depends on nothing N writes (weight
loads, index arithmetic) before `gdc_wait()`, which returns once N has finished and its writes
are visible.

The rules every kernel of a PDL chain keeps (`PDL: tl.constexpr` in its signature):
- `launch_dependents(PDL)` first;
- `wait(PDL)` before the first load of anything an earlier kernel of the step writes, and before
  any store (a store must not overtake a predecessor still reading the buffer). Because every
  kernel waits for its predecessor before it can finish, kernel N+1 completing implies every
  kernel before it completed: the chain stays ordered.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.triton_env import interpreting


@functools.cache
def _supported(device_index: int) -> bool:
    cuda_ext = getattr(getattr(tl, "extra", None), "cuda", None)
    if not hasattr(cuda_ext, "gdc_wait") or not hasattr(cuda_ext, "gdc_launch_dependents"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_supported(device: torch.device | int) -> bool:
    """Hopper or later, a Triton with the griddepcontrol ops, and not the CPU interpreter
    (which cannot run inline PTX)."""
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return False
        device = device.index if device.index is not None else torch.cuda.current_device()
    if interpreting() or not torch.cuda.is_available():
        return False
    return _supported(device)


def launch_options(pdl: bool) -> dict:
    """Extra launch arguments of a kernel in a PDL chain."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
