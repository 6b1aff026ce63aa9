"""This machine's memory, as `wd-engine models` and `wd-engine doctor` judge what fits: the CUDA
GPUs (through torch) and the main memory.

`WD_ENGINE_GPU_MEMORY_GB` (read here alone) stands in for the GPUs: one GPU of that many GB
(10^9 bytes), all of it free. It answers "would this model fit a 24 GB GPU?" on any machine, and
gives the verdicts without a GPU in tests. The engine's load check (`--gpu-memory-gb`) does not
read it: it measures the real device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GPU_MEMORY_ENV_VAR = "WD_ENGINE_GPU_MEMORY_GB"
GB = 10**9


@dataclass(frozen=True)
class Gpu:
    device: str  # "cuda:0"
    name: str
    total_bytes: int
    free_bytes: int
    faked: bool = False  # set from WD_ENGINE_GPU_MEMORY_GB


@dataclass(frozen=True)
class HostMemory:
    total_bytes: int
    available_bytes: int  # what new allocations can take without swapping (Linux: MemAvailable)


def gpu_memory_override(value: float | str | None = None) -> float | None:
    """The GPU memory to assume, in GB: `value` (a command's option), else
    WD_ENGINE_GPU_MEMORY_GB, else None (measure). ValueError unless positive."""
    if value is None:
        value = os.environ.get(GPU_MEMORY_ENV_VAR) or None
    if value is None:
        return None
    try:
        gb = float(value)
    except ValueError:
        raise ValueError(f"{GPU_MEMORY_ENV_VAR} must be a number of GB, got {value!r}") from None
    if not gb > 0:
        raise ValueError(f"the GPU memory to assume must be positive, got {value!r}")
    return gb


def gpus(override_gb: float | None = None) -> list[Gpu]:
    """The CUDA GPUs and their memory; with an override, one GPU of that size. Empty without
    CUDA (a CPU build of torch, no driver, no device)."""
    if override_gb is not None:
        size = round(override_gb * GB)
        return [Gpu("cuda:0", f"assumed ({GPU_MEMORY_ENV_VAR})", size, size, faked=True)]
    import torch

    if not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        found.append(Gpu(f"cuda:{index}", torch.cuda.get_device_name(index), total, free))
    return found


def host_memory() -> HostMemory:
    """The main memory, from /proc/meminfo where there is one, else sysconf (available: the
    free pages)."""
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        return HostMemory(fields["MemTotal"], fields.get("MemAvailable", fields["MemFree"]))
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        return HostMemory(page * os.sysconf("SC_PHYS_PAGES"), page * os.sysconf("SC_AVPHYS_PAGES"))
