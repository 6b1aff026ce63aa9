"""Each quantized kernel once on the GPU at the Qwen3-30B-A3B MoE shape, against float64 on the
dequantized weights; a kernel that fails to compile or run prints its error. A quick check before
the benchmarks (`python -m engine.bench.quant_smoke`)."""

from __future__ import annotations

import traceback

import torch

from engine.bench.moe_formats import Layers, error
from kernels.fused_moe import fused_moe
from kernels.gemv import skinny_linear
from kernels.quant import dequantize
from kernels.warp_decode import warp_decode_moe


def main() -> int:
    failed = 0
    for fmt in ("fp8", "int4"):
        layers = Layers(1, fmt)
        for batch in (1, 8, 64):
            args = layers.inputs(batch, seed=batch)[0]
            for name, fn in (("warp_decode", warp_decode_moe), ("expert_centric", fused_moe)):
                try:
                    print(f"{fmt} B={batch} {name}: error {error(fn, args):.2e}", flush=True)
                except Exception:  # noqa: BLE001 - reported, the next kernel still runs
                    failed += 1
                    print(f"{fmt} B={batch} {name} FAILED\n{traceback.format_exc()[-3000:]}")
        w = layers.down[0]
        w2 = type(w)(*(t[0] for t in w.parts()), *([w.block] if fmt == "fp8" else [w.group]))
        x = torch.randn(3, w2.shape[1], device="cuda").bfloat16()
        try:
            y = skinny_linear(x, w2).double()
            ref = x.double() @ dequantize(w2, torch.float64).T
            print(f"{fmt} skinny: error {float((y - ref).norm() / ref.norm()):.2e}")
        except Exception:  # noqa: BLE001
            failed += 1
            print(f"{fmt} skinny FAILED\n{traceback.format_exc()[-3000:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
