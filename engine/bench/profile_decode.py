"""Which kernels a decode step or a prefill spends its GPU time in, from torch's profiler.

    python -m engine.bench.profile_decode [--layers 8] [--context 4096] [--rows 1]  # a step
    python -m engine.bench.profile_decode --quant fp8 --fusions router+pdl          # FP8, a variant
    python -m engine.bench.profile_decode --prefill 4096 --chunk 512                # a prefill

A Qwen3-30B-A3B-shaped model with random weights (fewer layers: each layer is identical work),
its projections in bf16 or quantized by the project's quantizer (--quant). The decode step is the
engine's step (`engine.model.cuda_graph.DecodeStep`) with the engine's fusions or those of
--fusions, run without its graph, so each kernel's device time shows; the graph removes the
launch gaps between them.
"""

from __future__ import annotations

import argparse

import torch

from engine.bench.decode import parse_variants
from engine.kv.pool import KVPool, PagedBatch
from engine.loading.random_model import QWEN3_30B_A3B, random_model
from engine.model.cuda_graph import DecodeStep
from engine.model.step_kernels import DEFAULT_KERNELS


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=1, help="decode rows (sequences) in the step")
    ap.add_argument(
        "--prefill", type=int, default=0, help="profile a prefill of this many tokens instead"
    )
    ap.add_argument("--chunk", type=int, default=512, help="prefill tokens per forward")
    ap.add_argument("--quant", choices=("fp8", "int4"), help="quantized projections")
    ap.add_argument(
        "--fusions",
        type=parse_variants,
        help='the step\'s fusions joined by "+" ("unfused" for none), then any knobs as in '
        "engine.bench.decode's --variants; default: the engine's",
    )
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    if args.fusions is not None and len(args.fusions) != 1:
        ap.error("--fusions names one fusion set")
    kernels = DEFAULT_KERNELS if args.fusions is None else args.fusions[0].kernels()
    model = random_model(
        dict(QWEN3_30B_A3B, num_hidden_layers=args.layers),
        dtype=torch.bfloat16,
        device="cuda",
        quant=args.quant,
    )
    c, bs = model.config, 16
    tokens = max(args.context, args.prefill) + 16
    per_seq = -(-tokens // bs)
    pool = KVPool(
        c.num_layers, per_seq * args.rows, bs, c.num_kv_heads, c.head_dim, torch.bfloat16, "cuda"
    )
    tables = [list(range(r * per_seq, (r + 1) * per_seq)) for r in range(args.rows)]

    if args.prefill:
        ids = torch.randint(0, c.vocab_size, (1, args.prefill), device="cuda")

        def work():
            for start in range(0, args.prefill, args.chunk):
                end = min(args.prefill, start + args.chunk)
                model.forward(
                    ids[:, start:end],
                    torch.arange(start, end, device="cuda")[None],
                    PagedBatch(pool, tables[:1], "cuda"),
                    last_only=True,
                )

        what = f"prefill of {args.prefill} tokens in chunks of {args.chunk}"
    else:
        step = DecodeStep(model, pool, args.rows, per_seq, kernels=kernels)
        step.load([7] * args.rows, [args.context] * args.rows, tables)
        work = step
        fusions = "+".join(sorted(step.ops.fusions)) or "unfused"
        what = (
            f"{args.quant or 'bf16'} decode step ({fusions}), {args.rows} rows at context "
            f"{args.context}"
        )

    for _ in range(2):
        work()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        work()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events) / 1000
    print(
        f"{what}, {args.layers} layers: GPU busy {gpu_ms:.2f} ms "
        f"({gpu_ms / args.layers:.3f} ms per layer)"
    )
    print(
        events.table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=60)
    )


if __name__ == "__main__":
    main()
