"""Does a quantized Qwen3-30B-A3B serve under a GPU memory cap? One process, capped as
`serve --gpu-memory-gb` caps it (the allocator's per-process fraction): random weights quantized
by the project's quantizer, the KV pool sized to what the cap leaves, a 4K prompt prefilled in
the engine's chunks, then CUDA-graph decode steps at batch 1 and 8.

    python -m engine.bench.fit --quant fp8 --gpu-memory-gb 40
    python -m engine.bench.fit --quant int4 --gpu-memory-gb 24
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from engine.core.options import EngineOptions
from engine.kv.pool import KVPool, PagedBatch
from engine.loading.memory import (
    capped_kv_pool_bytes,
    gpu_budget,
    gpu_bytes_in_use,
    kv_bytes_per_token,
)
from engine.loading.random_model import SHAPES, random_model
from engine.model.cuda_graph import DecodeGraphs
from engine.model.qwen3_moe import weight_bytes

BLOCK = 16
PROMPT = 4096


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--quant", choices=("fp8", "int4"))
    ap.add_argument("--quant-lm-head", action="store_true", help="with --quant: the lm_head too")
    ap.add_argument("--gpu-memory-gb", type=float, required=True)
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        help="prompt tokens a forward (default: the engine's chunk on CUDA)",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    chunk = args.prefill_chunk or EngineOptions().chunk_for(torch.device("cuda"))
    if args.quant_lm_head and not args.quant:
        ap.error("--quant-lm-head needs --quant")
    log = logging.getLogger("fit")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    budget = gpu_budget("cuda", args.gpu_memory_gb, log)
    model = random_model(
        SHAPES[args.shape], device="cuda", quant=args.quant, quant_lm_head=args.quant_lm_head
    )
    cfg = model.config
    used = gpu_bytes_in_use("cuda")
    per_token = kv_bytes_per_token(cfg)
    kv = capped_kv_pool_bytes(budget, used, None, 8192 * per_token)
    blocks = kv // (per_token * BLOCK)
    pool = KVPool(
        cfg.num_layers, blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, model.dtype, "cuda"
    )
    result = dict(
        quant=args.quant,
        quant_lm_head=args.quant_lm_head,
        cap_gb=args.gpu_memory_gb,
        weight_gb=weight_bytes(model) / 1e9,
        in_use_after_load_gb=used / 1e9,
        kv_pool_gb=kv / 1e9,
        kv_tokens=blocks * BLOCK,
        prefill_chunk=chunk,
    )
    log.info(
        "%s: weights %.2f GB (allocator %.2f GB) built in %.0f s; KV pool %.2f GB = %d tokens",
        args.quant or "bf16",
        result["weight_gb"],
        result["in_use_after_load_gb"],
        time.perf_counter() - t0,
        result["kv_pool_gb"],
        result["kv_tokens"],
    )
    # A 4K prompt per sequence for 8 sequences, prefilled in the engine's chunks, then decoding.
    per_seq = -(-(PROMPT + 64) // BLOCK)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(8)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    t1 = time.perf_counter()
    for table in tables:
        ids = torch.randint(0, cfg.vocab_size, (1, PROMPT), generator=gen, device="cuda")
        for start in range(0, PROMPT, chunk):
            end = min(PROMPT, start + chunk)
            positions = torch.arange(start, end, device="cuda")[None]
            model.forward(
                ids[:, start:end],
                positions,
                PagedBatch(pool, [table], "cuda"),
                last_only=True,
            )
    torch.cuda.synchronize()
    result["prefill_s_8x4k"] = time.perf_counter() - t1
    graphs = DecodeGraphs(model, pool, PROMPT + 64, buckets=(1, 8))
    for batch in (1, 8):
        for step in range(16):
            graphs.run([1] * batch, [PROMPT + step] * batch, tables[:batch])
    torch.cuda.synchronize()
    result["max_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    result["ok"] = result["max_reserved_gb"] <= args.gpu_memory_gb
    log.info(
        "prefill 8 x %d tokens in chunks of %d %.1f s; decode at batch 1 and 8 ran; "
        "peak reserved %.2f GB under the %.0f GB cap: %s",
        PROMPT,
        chunk,
        result["prefill_s_8x4k"],
        result["max_reserved_gb"],
        args.gpu_memory_gb,
        "ok" if result["ok"] else "OVER",
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
