"""The expert-centric MoE layer at prompt-chunk sizes in bf16, FP8 and int4, its tiles tuned per
weight format (GPU).

    python -m engine.bench.prefill_moe --out prefill_moe.json          # the tiles in use, timed
    python -m engine.bench.prefill_moe --tune --out prefill_moe.json   # sweep them, store the best

Shape and weights as engine.bench.moe_formats (Qwen3-30B-A3B's MoE layer, random weights quantized
by the project's quantizers, several layers cycled). A prompt chunk routes hundreds of tokens to
each expert, so the GEMMs are compute-bound; a quantized tile's values are converted and scaled on
the CUDA cores before the tensor cores see them, and how many rows share that work (BLOCK_M) and
how many columns share a scale (BLOCK_K) decide what it costs. `--tune` sweeps BLOCK_M, then for
FP8 where the block scales go (on the partial products, or on the weights: half the accumulator
registers), then the gate/up GEMM's tile with the down GEMM's fixed, then the down GEMM's;
each candidate is the whole layer under a CUDA graph, checked against the tiles in use first. The
best per format and chunk size go into `kernels/configs/fused_moe[_fp8|_int4]_*.json` (other
entries kept), which kernels.fused_moe.default_config reads.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.bench.moe_formats import FORMATS, SHAPE, Layers, time_us
from kernels import tuned
from kernels.fused_moe import default_config, fused_moe
from kernels.fused_moe import table_name as fused_moe_table
from kernels.quant import format_name

TOKENS = (512, 2048)  # the scheduler's chunks on the CPU and on CUDA
PREFILL_BLOCK_M = (64, 128)
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of one GEMM; FP8 and int4 steps never straddle a
# scale (kernels.quant_tiles.k_step shrinks BLOCK_K where they would).
PREFILL_TILES = (
    (128, 64, 8, 4),
    (128, 128, 8, 3),
    (64, 128, 4, 4),
    (128, 64, 4, 4),
    (256, 64, 8, 3),
    (64, 64, 4, 4),
    (128, 128, 4, 3),
)
AGREEMENT = 1e-2  # a candidate against the tiles in use: bf16 sums in another order


def tile(spec: tuple) -> dict:
    block_n, block_k, warps, stages = spec
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages}


def table_name(fmt: str) -> str:
    """The format's fused_moe table at the benchmark's shape."""
    return fused_moe_table(fmt, SHAPE["hidden"], SHAPE["inter"], SHAPE["experts"], SHAPE["top_k"])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def sweep(inputs: list, base: dict, measure, log) -> tuple[dict, float, dict]:
    """(best config, its µs, {"base_us", "candidates"}) over BLOCK_M, then gate/up tiles, then
    down tiles, each round from the best of the last. `measure(cfg)`: µs of the layer with the
    config; a config whose output is not the base's (on inputs[0]) is never chosen."""
    want = fused_moe(*inputs[0], config=base)
    timed: dict[str, float] = {}

    def time_config(cfg: dict) -> float:
        key = json.dumps(cfg, sort_keys=True)
        if key not in timed:
            try:
                err = relative(fused_moe(*inputs[0], config=cfg), want)
                if err > AGREEMENT:
                    log(f"  {cfg}: wrong output (relative {err:.2e}), skipped")
                    timed[key] = float("inf")
                else:
                    timed[key] = measure(cfg)
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit
                log(f"  {cfg}: failed ({type(exc).__name__}: {exc})")
                timed[key] = float("inf")
        return timed[key]

    base_us = time_config(base)
    best = min([dict(base, BLOCK_M=m) for m in PREFILL_BLOCK_M] + [base], key=time_config)
    if format_name(inputs[0][2]) == "fp8":  # FP8 scales on the weights: fewer registers
        scaled = {g: dict(best[g], SCALE_WEIGHTS=True) for g in ("gate_up", "down")}
        best = min([best, dict(best, **scaled)], key=time_config)
    for kernel in ("gate_up", "down"):
        scale = {k: v for k, v in best[kernel].items() if k == "SCALE_WEIGHTS"}
        options = [dict(best, **{kernel: dict(tile(spec), **scale)}) for spec in PREFILL_TILES]
        best = min(options + [best], key=time_config)
    return best, time_config(best), {"base_us": base_us, "candidates": len(timed)}


def layer_time(inputs: list, replays: int):
    """measure(cfg) for `sweep`: µs a layer of fused_moe with the config, over every layer."""

    def measure(cfg: dict) -> float:
        return time_us(lambda *args: fused_moe(*args, config=cfg), inputs, replays)

    return measure


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--tune", action="store_true", help="sweep the tiles and store the best")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    device = torch.cuda.get_device_name()
    h, i, e, k = SHAPE["hidden"], SHAPE["inter"], SHAPE["experts"], SHAPE["top_k"]
    result: dict = {"device": device, "shape": SHAPE, "rows": []}
    for fmt in args.formats.split(","):
        layers = Layers(args.layers, fmt)
        best_of: dict[str, dict] = {}
        for tokens in (int(t) for t in args.tokens.split(",")):
            inputs = layers.inputs(tokens, seed=tokens)
            base = default_config(tokens, h, i, e, k, fmt)
            row = {"format": fmt, "tokens": tokens, "config": base}
            if args.tune:
                measure = layer_time(inputs, args.replays)
                best, best_us, info = sweep(inputs, base, measure, log)
                row.update(info, best=best, best_us=best_us)
                best_of[str(tokens)] = best
                line = f"stored {info['base_us']:8.1f} µs, best {best_us:8.1f} µs {best}"
            else:
                row["base_us"] = time_us(fused_moe, inputs, args.replays)
                line = f"{row['base_us']:8.1f} µs {base}"
            row["tok_s"] = tokens / (row.get("best_us", row["base_us"]) * 1e-6)
            log(f"{fmt:>4} {tokens:5d} tokens: {line} ({row['tok_s']:,.0f} tok/s a layer)")
            result["rows"].append(row)
            if args.out:
                args.out.write_text(json.dumps(result, indent=1) + "\n")
        if best_of:
            name = table_name(fmt)
            table = dict(tuned.load(name) or {}, device=device)
            table["configs"] = {**table.get("configs", {}), **best_of}
            tuned.save(name, table)
            log(f"stored {name}")
        del layers
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
