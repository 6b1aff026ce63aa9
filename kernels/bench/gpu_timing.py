"""GPU timing for the benchmarks: CUDA-graph replays timed with events, and read bandwidth.

Decode-sized MoE layers run for tens of microseconds, where launch gaps matter as much as the
kernels; the engine replays CUDA graphs, so the benchmark does too. One graph runs the layer
for every weight set in turn (weights cycled so L2 cannot hold them); the time per layer is
the median replay time over the number of layers in it.
"""

from __future__ import annotations

import statistics
from functools import partial

import torch
import triton
import triton.language as tl


def graph_time_us(fn, replays: int = 100, warmup: int = 5) -> float:
    """Median microseconds of one replay of a CUDA graph of `fn()` (fn must be capturable)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and allocate outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    del graph
    return statistics.median(times)


@triton.jit
def _read_kernel(src_ptr, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    base = src_ptr + pid * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        acc += tl.load(base + i * BLOCK + offs).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read_bandwidth(n_bytes: int = 2 << 30) -> dict:
    """Device-memory read bandwidth (bytes/s): a streaming read of a buffer far past L2.

    Also reports torch's copy bandwidth (read + write bytes) as a cross-check.
    """
    n = n_bytes // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    results = {}
    for block, iters, warps in ((4096, 16, 8), (2048, 32, 4), (8192, 8, 8)):
        grid = n // (block * iters)
        out = torch.empty(grid, device="cuda", dtype=torch.float32)
        ms = triton.testing.do_bench(
            partial(_read_kernel[(grid,)], src, out, BLOCK=block, ITERS=iters, num_warps=warps),
            warmup=25,
            rep=200,
            return_mode="median",
        )
        results[f"read_{block}x{iters}_w{warps}"] = grid * block * iters * 2 / (ms * 1e-3)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(partial(dst.copy_, src), warmup=25, rep=200, return_mode="median")
    copy = 2 * n * 2 / (ms * 1e-3)
    read = max(results.values())
    return {"read_bytes_per_s": read, "copy_bytes_per_s": copy, "read_variants": results}
