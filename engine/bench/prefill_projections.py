"""A prompt chunk's quantized attention projections: what dequantizing them for the library GEMM
costs, in torch ops (kernels.quant.dequantize) against one pass (kernels.dequantize), beside
the GEMM itself and the bf16 weight's GEMM, each against its floor (bytes / read bandwidth).

    python -m engine.bench.prefill_projections                      # a GPU, Qwen3-30B-A3B sizes
    python -m engine.bench.prefill_projections --rows 2048,4096 --out prefill_projections.json
    python -m engine.bench.prefill_projections --shape tiny --device cpu   # the checks only

Each one-pass result is checked equal to the torch dequantize first; weights are cycled so L2
cannot hold them (engine.bench.projections' copies).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.bench.projections import projection_sizes, weights
from engine.loading.random_model import SHAPES
from kernels.dequantize import dequantize_weight
from kernels.quant import dequantize, nbytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--formats", default="fp8,int4")
    ap.add_argument("--rows", default="2048", help="prompt-chunk rows, comma-separated")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--device", default="cuda", help="cpu: the checks only (Triton interpreter)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    timed = args.device != "cpu"
    if timed:
        from kernels.bench.gpu_timing import graph_time_us, read_bandwidth

        bandwidth = read_bandwidth()["read_bytes_per_s"]
        print(f"{torch.cuda.get_device_name()}; read bandwidth {bandwidth / 1e12:.2f} TB/s")
    else:
        bandwidth = None

    def per_weight(fn, ws) -> float:
        """Microseconds of fn(w) per weight, the copies cycled in one graph."""
        return graph_time_us(lambda: [fn(w) for w in ws]) / len(ws)

    results = []
    for name, (n_out, k_in) in projection_sizes(SHAPES[args.shape]).items():
        if name == "lm_head":  # a prefill reads only its last row's logits
            continue
        gemm_us = {}  # the bf16 GEMM of each chunk size, what either format's dequantize feeds
        if timed:
            plain = weights("bf16", n_out, k_in, args.device, args.copies, seed=n_out)
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, k_in, device=args.device, dtype=torch.bfloat16)
                gemm_us[f"gemm_bf16_{rows}_us"] = per_weight(lambda w, x=x: F.linear(x, w), plain)
        for fmt in args.formats.split(","):
            ws = weights(fmt, n_out, k_in, args.device, args.copies, seed=n_out)
            one_pass = dequantize_weight(ws[0], torch.bfloat16)
            assert torch.equal(one_pass, dequantize(ws[0], torch.bfloat16)), "one pass differs"
            if not timed:
                print(f"{name:>4} {fmt:>4} [{n_out} x {k_in}]: one pass equals torch's")
                continue
            row = dict(projection=name, format=fmt, n_out=n_out, k_in=k_in)
            row["dequantize_floor_us"] = (nbytes(ws[0]) + 2 * n_out * k_in) / bandwidth * 1e6
            row["torch_dequantize_us"] = per_weight(lambda w: dequantize(w, torch.bfloat16), ws)
            row["one_pass_us"] = per_weight(lambda w: dequantize_weight(w, torch.bfloat16), ws)
            row.update(gemm_us)
            results.append(row)
            gemms = "  ".join(f"GEMM {k.split('_')[2]} rows {v:7.1f}" for k, v in gemm_us.items())
            print(
                f"{name:>4} {fmt:>4} [{n_out} x {k_in}]  floor {row['dequantize_floor_us']:6.1f}"
                f"  torch {row['torch_dequantize_us']:7.1f}  one pass {row['one_pass_us']:6.1f}"
                f"  ({row['torch_dequantize_us'] / row['one_pass_us']:.1f}x)  {gemms}  µs"
            )
    if args.out:
        args.out.write_text(json.dumps(dict(bandwidth=bandwidth, rows=results), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
