"""Paged decode attention on the GPU: check against the torch reference at real shapes, then
time it against its floor (the K/V bytes it must read over measured bandwidth).

    python -m kernels.bench.attention [--json PATH]

Shape: Qwen3-30B-A3B attention (32 query heads, 4 KV heads, head dim 128), block size 16,
blocks scattered over the pool, bf16 and fp8 storage, batch 1/4/8 at 1K/4K/16K context.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

from kernels import reference as ref
from kernels.paged_attention import paged_decode_attention

HQ, HKV, D, BS = 32, 4, 128, 16


def build(batch, context, fp8, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = batch * (context // BS) + 8
    keys = torch.randn(blocks * BS, HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
    values = torch.randn(blocks * BS, HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
    tables = torch.randperm(blocks, device="cuda", generator=g)[: batch * (context // BS)]
    tables = tables.view(batch, -1).to(torch.int32)
    lengths = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", generator=g, dtype=torch.bfloat16)
    ks = vs = None
    if fp8:
        ks = keys.float().abs().amax(-1) / 448.0
        vs = values.float().abs().amax(-1) / 448.0
        keys = (keys.float() / ks[..., None]).to(torch.float8_e4m3fn)
        values = (values.float() / vs[..., None]).to(torch.float8_e4m3fn)
    return q, keys, values, tables, lengths, ks, vs


def reference(q, keys, values, tables, lengths, ks, vs):
    out = []
    for b in range(q.shape[0]):
        n = int(lengths[b])
        slots = (tables[b].long()[:, None] * BS + torch.arange(BS, device="cuda")).reshape(-1)[:n]
        k, v = keys[slots].double(), values[slots].double()
        if ks is not None:
            k, v = k * ks[slots][..., None].double(), v * vs[slots][..., None].double()
        o = ref.attention(
            q[b : b + 1, :, None].double(),
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            torch.tensor([[n - 1]], device="cuda"),
        )
        out.append(o[0, :, 0])
    return torch.stack(out)


def bandwidth() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    from triton.testing import do_bench

    ms = do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    return 2 * x.numel() / (ms / 1000)


def time_graph(fn, reps=200) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2] * 1000  # µs


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    bw = bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    print(f"{'fmt':>5} {'B':>3} {'ctx':>6} {'err':>9} {'µs':>8} {'floor µs':>9} {'of floor':>8}")
    for fp8 in (False, True):
        for batch in (1, 4, 8):
            for context in (1024, 4096, 16384):
                q, keys, values, tables, lengths, ks, vs = build(batch, context, fp8)
                out = paged_decode_attention(q, keys, values, tables, lengths, BS, ks, vs)
                exact = reference(q, keys, values, tables, lengths, ks, vs)
                err = ((out.double() - exact).norm() / exact.norm()).item()
                us = time_graph(
                    partial(paged_decode_attention, q, keys, values, tables, lengths, BS, ks, vs)
                )
                kv_bytes = batch * context * HKV * D * 2 * keys.element_size()
                if fp8:
                    kv_bytes += batch * context * HKV * 2 * 4
                floor = kv_bytes / bw * 1e6
                row = dict(
                    format="fp8" if fp8 else "bf16",
                    batch=batch,
                    context=context,
                    rel_err=err,
                    us=us,
                    floor_us=floor,
                )
                rows.append(row)
                print(
                    f"{row['format']:>5} {batch:>3} {context:>6} {err:>9.2e} {us:>8.1f} "
                    f"{floor:>9.1f} {floor / us:>7.0%}"
                )
                assert err < 2e-2, f"paged attention error {err} too large"
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(bandwidth=bw, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
