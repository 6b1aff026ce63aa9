"""How many intra-op threads a small model's CPU forward runs on.

A short forward's ops are too small to gain from splitting, and while another process keeps a
core busy each split op waits for a thread that cannot run; a long one gains from every thread
on a free host but collapses like the short ones when another process holds a core. So short
forwards run on one thread, long ones on as many as other processes left cores free
(engine.model.host_load). BENCHMARKS.md has the measurements behind both numbers.
"""

from __future__ import annotations

import contextlib
import math

import torch

from engine.model import host_load

# A CPU forward of at most this many tokens (decode steps, short prompts) runs on one thread.
CPU_ONE_THREAD_MAX_TOKENS = 64
# A longer one runs on as many threads as other processes left cores free, give or take this
# much of a core, at least one: on 2 cores, two threads while others keep at most half a core
# busy, else one (two threads still won against a neighbour busy a quarter of the time, broke
# even at half, lost at three quarters). Where the load is unknown, all threads.
CPU_FREE_CORE_MARGIN = 0.5
# Only OpenMP builds of torch change intra-op threads mid-process; elsewhere the call can warn
# and pin the whole process to the first setting.
THREADS_ADJUSTABLE = "OpenMP" in torch.__config__.parallel_info()


def for_forward(n_tokens: int) -> int:
    """Intra-op threads for a small model's CPU forward of n_tokens. The host's load is asked at
    every forward, decode steps included, so that while completions run the estimate a prefill
    reads covers about the last 50 ms (a look is reused for 50 ms)."""
    threads = _for_long_forward()
    return threads if n_tokens > CPU_ONE_THREAD_MAX_TOKENS else 1


def _for_long_forward() -> int:
    """The configured number of threads, less those other processes' busy cores would leave
    without a core (see CPU_FREE_CORE_MARGIN), at least one; the configured number where the
    load is unknown."""
    configured = torch.get_num_threads()
    load = host_load.others_busy_cores() if THREADS_ADJUSTABLE else None
    if load is None:
        return configured
    others, cores = load
    return max(1, min(configured, math.floor(cores - others + CPU_FREE_CORE_MARGIN)))


@contextlib.contextmanager
def intra_op_threads(count: int = 1):
    """Torch's intra-op threads set to `count` for the block. The engine runs all model work on
    one thread, whose setting this changes."""
    threads = torch.get_num_threads()
    if threads == count or not THREADS_ADJUSTABLE:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
