"""Where one batch-1 decode step spends its time on the GPU (no CUDA graphs): wall time of the
step, GPU time, and the costliest ops by host time, from torch's profiler.

    python -m engine.profile_decode [--layers 8] [--context 4096]

A Qwen3-30B-A3B-shaped model with random weights (fewer layers: each layer is identical work).
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.kv_pool import KVPool, PagedBatch
from engine.random_model import QWEN3_30B_A3B, random_model


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args(argv)
    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    model = random_model(cfg, dtype=torch.bfloat16, device="cuda")
    c = model.config
    bs = 16
    blocks = args.context // bs + 2
    pool = KVPool(c.num_layers, blocks, bs, c.num_kv_heads, c.head_dim, torch.bfloat16, "cuda")
    table = [list(range(blocks))]
    prompt = torch.randint(0, 16000, (1, args.context), device="cuda")
    for start in range(0, args.context, 512):  # chunked prefill, as the scheduler does
        model.forward(prompt[:, start:start + 512], torch.arange(start, start + 512, device="cuda")[None],
                      PagedBatch(pool, table, "cuda"), last_only=True)
    token = torch.tensor([[7]], device="cuda")
    pos = torch.tensor([[args.context]], device="cuda")

    def step():
        return model.forward(token, pos, PagedBatch(pool, table, "cuda"))

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 10
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n * 1000
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / 1  # µs over the step
    print(f"{args.layers} layers, context {args.context}: decode step {wall:.2f} ms wall "
          f"({wall / args.layers:.3f} ms/layer), GPU busy {gpu_us / 1000:.2f} ms")
    print(events.table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
