"""The decode step's projections (q/k/v, o and the lm_head) at a model shape's sizes: cuBLAS on
bf16 weights against the Triton skinny GEMV (kernels.gemv) on bf16, FP8 and int4 weights, with a
sweep of the GEMV's tiles, each against the floor (bytes / measured read bandwidth).

    python -m engine.bench.projections --out projections.json      # a GPU, Qwen3-30B-A3B sizes
    python -m engine.bench.projections --tune                       # ... and store the best tiles
    python -m engine.bench.projections --shape tiny --device cpu   # the checks only, interpreter

Each case is checked against float64 on the dequantized weights before it is timed; weights are
cycled (one graph runs every copy) so L2 cannot hold them. `--tune` writes each format and size's
best tile per row count to kernels/configs/ (kernels.gemv.table_name), which the GEMV then takes
for every call that names no tile, and for bf16 whether it beat cuBLAS (then the model's
projections take it: kernels.quant_linear); the fastest tile is checked against float64 again.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.loading import fp8, int4
from engine.loading.random_model import SHAPES
from kernels import tuned
from kernels.gemv import skinny_linear, table_name
from kernels.quant import dequantize, kernel_weight, nbytes
from kernels.quant_tiles import scale_weights

# (block_n, block_k, num_warps, split_k); split_k None: the kernel's default_split_k.
TILES = list(itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (1, 2, 4, 8, 16)))
DEFAULT_TILE = (16, 256, 4, None)
UNSPLIT_TILE = (16, 256, 4, 1)


# The fastest tiles of a quantized format timed again with its scales placed the other way.
SCALE_ROUND = 4


def tile_config(tile: tuple) -> dict:
    """A tile tuple (block_n, block_k, num_warps, split_k[, scale_weights]) as skinny_linear's
    arguments; scale_weights only where it was set."""
    block_n, block_k, num_warps, split_k, *scales = tile
    cfg = dict(block_n=block_n, block_k=block_k, num_warps=num_warps, split_k=split_k)
    if scales and scales[0] is not None:
        cfg["scale_weights"] = scales[0]
    return cfg


def projection_sizes(shape: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of the decode step's attention projections and lm_head."""
    heads, kv, dim, hidden = (
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        shape["head_dim"],
        shape["hidden_size"],
    )
    return {
        "qkv": ((heads + 2 * kv) * dim, hidden),
        "o": (hidden, heads * dim),
        "lm_head": (shape["vocab_size"], hidden),
    }


def weights(fmt: str, n_out: int, k_in: int, device, copies: int, seed: int) -> list:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    size = 128 if k_in % 128 == 0 else 32  # blocks / groups (the tiny shape's are narrow)
    out = []
    for _ in range(copies):
        w = (torch.randn(n_out, k_in, generator=gen) * k_in**-0.5).to(device)
        if fmt == "fp8":
            out.append(fp8.quantized_weight(w.bfloat16(), size))
        elif fmt == "int4":
            out.append(int4.quantized_weight(w.bfloat16(), size))
        else:
            out.append(w.bfloat16())
    return out


def relative_error(y: torch.Tensor, x: torch.Tensor, w) -> float:
    ref = x.double() @ dequantize(w, torch.float64).T
    return float((y.double() - ref).norm() / ref.norm())


def time_case(x: torch.Tensor, ws: list, fmt: str, tiles: list) -> dict:
    """Microseconds per product: cuBLAS (bf16 weights only), the GEMV's default tile (with its
    default split of K), the default tile unsplit, and the best of the sweep (for a quantized
    format, its fastest tiles also with the scales placed the other way)."""
    from kernels.bench.gpu_timing import graph_time_us

    def per_product(fn) -> float:
        return graph_time_us(lambda: [fn(w) for w in ws]) / len(ws)

    out = {}
    if fmt == "bf16":
        out["cublas_us"] = per_product(lambda w: F.linear(x, w))
    times = {}

    def time_tile(tile: tuple) -> None:
        try:
            times[tile] = per_product(lambda w: skinny_linear(x, w, **tile_config(tile)))
        except Exception:  # noqa: BLE001 - a tile that does not fit is skipped
            pass

    for tile in tiles:
        time_tile(tile)
    if fmt != "bf16":  # the other scale placement (kernels.quant_tiles.quantized_dot)
        flipped = not scale_weights(kernel_weight(ws[0]), None)
        for tile in sorted(times, key=times.get)[:SCALE_ROUND]:
            time_tile((*tile[:4], flipped))
    best = min(times, key=times.get)
    out.update(
        default_us=times.get(DEFAULT_TILE),
        unsplit_us=times.get(UNSPLIT_TILE),
        best_us=times[best],
        best_tile=tile_config(best),
        tiles_us={"x".join(map(str, tile)): us for tile, us in times.items()},
    )
    return out


def store_tuned(cases: list, device_name: str) -> list:
    """Each (format, size)'s best tile per row count into its table in kernels/configs/."""
    tables: dict = {}
    for case in cases:
        name = table_name(case["fmt"], case["out"], case["k"])
        entry = dict(case["best_tile"])
        if "cublas_us" in case:
            entry["beats_library"] = case["best_us"] < case["cublas_us"]
        tables.setdefault(name, {})[str(case["rows"])] = entry
    return [
        str(tuned.save(name, {"device": device_name, "configs": configs}))
        for name, configs in tables.items()
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--formats", default="bf16,fp8,int4")
    ap.add_argument("--projections", default="qkv,o,lm_head", help="which of qkv, o, lm_head")
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--tune", action="store_true", help="store each case's best tile")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.tune and not (args.sweep and args.device.startswith("cuda")):
        ap.error("--tune needs the sweep on a GPU")
    cuda = args.device.startswith("cuda")
    results: dict = {"shape": args.shape, "cases": []}
    if cuda:
        from kernels.bench.gpu_timing import read_bandwidth

        bandwidth = read_bandwidth()["read_bytes_per_s"]
        results["read_bytes_per_s"] = bandwidth
        print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    sizes = projection_sizes(SHAPES[args.shape])
    for name in args.projections.split(","):
        if name not in sizes:
            ap.error(f"unknown projection {name!r}; known: {', '.join(sizes)}")
    for name in args.projections.split(","):
        n_out, k_in = sizes[name]
        for fmt in args.formats.split(","):
            copies = 12 if cuda and n_out * k_in < 1 << 26 else (2 if cuda else 1)  # > L2
            ws = weights(fmt, n_out, k_in, args.device, copies, seed=n_out + k_in)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k_in, device=args.device).bfloat16()
                err = relative_error(skinny_linear(x, ws[0]), x, ws[0])
                case = dict(proj=name, fmt=fmt, rows=rows, out=n_out, k=k_in, error=err)
                if cuda:
                    floor_us = nbytes(ws[0]) / bandwidth * 1e6
                    case["floor_us"] = floor_us
                    tiles = TILES + [DEFAULT_TILE] if args.sweep else [DEFAULT_TILE, UNSPLIT_TILE]
                    case.update(time_case(x, ws, fmt, tiles))
                    best = skinny_linear(x, ws[0], **case["best_tile"])
                    case["best_error"] = relative_error(best, x, ws[0])
                results["cases"].append(case)
                line = f"{name:>7} {fmt:>4} rows={rows:<2} err {err:.2e}"
                if cuda:
                    cublas = case.get("cublas_us")
                    line += (
                        f"  floor {case['floor_us']:6.1f}"
                        + (f"  cuBLAS {cublas:6.1f}" if cublas else " " * 15)
                        + f"  gemv default {case['default_us'] or float('nan'):6.1f}"
                        + f"  unsplit {case['unsplit_us'] or float('nan'):6.1f}"
                        + f"  best {case['best_us']:6.1f} {case['best_tile']}"
                    )
                print(line, flush=True)
                if args.tune:  # after every case: a run cut short keeps what it measured
                    results["tables"] = store_tuned(results["cases"], torch.cuda.get_device_name())
                if args.out:
                    args.out.write_text(json.dumps(results, indent=1))
    if args.tune:
        print("stored: " + ", ".join(results["tables"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
