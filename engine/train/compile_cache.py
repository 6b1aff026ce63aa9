"""torch.compile's artifacts carried from one training stint to the next.

A stint on a lent GPU machine starts on a bare machine, so the compiled training step is built
again each time, which takes minutes of a short budget. torch's portable cache
(`torch.compiler.save_cache_artifacts`) holds what the build made (Inductor's code, AOTAutograd's
graphs, Triton's binaries and autotuning); loaded before the first step on a machine with the
same torch, Triton and GPU, the build finds them instead of redoing the work. Anything else
(another GPU, a newer torch, a damaged file) is a miss, never an error: the step is compiled as
if there were no cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def load(path: Path) -> str:
    """Hand the artifacts in `path` to torch before anything is compiled; returns what happened,
    for the log."""
    if not path.is_file():
        return f"compile cache: none at {path}"
    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be read is a miss
        return f"compile cache: {path} not loaded ({type(exc).__name__}: {exc})"
    if info is None:  # torch logs why (a damaged file, another torch's format)
        return f"compile cache: {path} not loaded (nothing usable in it)"
    return f"compile cache: loaded {path.stat().st_size:,} bytes from {path} {_kinds(info)}"


def save(path: Path) -> str:
    """Write what this process compiled so far to `path` (replaced whole, never half-written);
    returns what happened, for the log."""
    try:
        artifacts = torch.compiler.save_cache_artifacts()
    except Exception as exc:  # noqa: BLE001 - a run without a cache to bring back still trains
        return f"compile cache: not saved ({type(exc).__name__}: {exc})"
    if artifacts is None:
        return "compile cache: nothing compiled to save"
    data, info = artifacts
    partial = path.with_name(path.name + ".partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(data)
        os.replace(partial, path)
    except OSError as exc:  # a full or read-only disk costs the next stint its cache, no more
        return f"compile cache: not saved to {path} ({exc})"
    return f"compile cache: saved {len(data):,} bytes to {path} {_kinds(info)}"


def _kinds(info) -> dict[str, int]:
    """How many artifacts of each kind (Inductor, AOTAutograd, autotuning ...), for the log."""
    return {kind: len(keys) for kind, keys in info.artifacts.items()}
