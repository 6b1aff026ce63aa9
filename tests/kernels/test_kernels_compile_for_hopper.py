"""Every MoE and GEMV kernel, in every weight format, compiled for Hopper (sm90) without a GPU.

The interpreter runs a kernel's Python, not its compilation: code the interpreter accepts can
still fail to compile (e.g. returns of different types in branches a constexpr rules out), and
then only a GPU run would show it. `triton.compile` to PTX needs no device. The tests run without
the interpreter, so the test re-runs this module in a process without TRITON_INTERPRET (the
tests' conftest sets it before Triton is imported):
`python -m tests.kernels.test_kernels_compile_for_hopper`.
"""

import os
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import fused_moe, gemv, warp_decode
from kernels.quant import FP8_BLOCKS, INT4_GROUPS, PLAIN

HOPPER = GPUTarget("cuda", 90, 32)
# The stored weight's and its scales' pointer types, per format.
STORED = {PLAIN: ("bf16", "bf16"), FP8_BLOCKS: ("u8", "fp32"), INT4_GROUPS: ("i32", "bf16")}
FORMAT_CONSTS = {
    PLAIN: dict(SCALE_ROWS=1, SCALE_COLS=1, PER_ITEM=1),
    FP8_BLOCKS: dict(SCALE_ROWS=128, SCALE_COLS=128, PER_ITEM=1),
    INT4_GROUPS: dict(SCALE_ROWS=1, SCALE_COLS=128, PER_ITEM=8),
}


def compile_for_hopper(kernel, pointers: dict, constants: dict, **options):
    """PTX of `kernel` with these pointer element types and constexprs; other args are i32."""
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "i32"
    aligned = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    compiled = triton.compile(
        ASTSource(kernel, signature, constants, aligned), target=HOPPER, options=options
    )
    return compiled.asm["ptx"]


FORMATS = [PLAIN, FP8_BLOCKS, INT4_GROUPS]
ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernels.test_kernels_compile_for_hopper"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.count("compiled") == 3 * len(FORMATS), run.stdout


def warp_decode_compiles(fmt):
    w, s = STORED[fmt]
    # Tiles within one FP8 block's columns, and tiles spanning several.
    for block_h, block_i in ((128, 128), (512, 256)) if fmt == FP8_BLOCKS else ((128, 128),):
        gate_up = compile_for_hopper(
            warp_decode._gate_up_silu_kernel,
            dict(x_ptr="bf16", w_ptr=w, s_ptr=s, ids_ptr="i64", out_ptr="bf16", wdown_ptr=w),
            dict(
                BLOCK_I=8,
                BLOCK_H=block_h,
                EVEN_I=True,
                EVEN_H=True,
                FORMAT=fmt,
                LAUNCH_DEPS=True,
                DOWN_LINES=0,
                LINE_ELEMS=64,
                EVICT="",
                **FORMAT_CONSTS[fmt],
            ),
            num_warps=4,
        )
        down = compile_for_hopper(
            warp_decode._down_kernel,
            dict(act_ptr="bf16", w_ptr=w, s_ptr=s, ids_ptr="i64", weights_ptr="fp32", y_ptr="bf16"),
            dict(
                K_PAD=8,
                BLOCK_H=4,
                BLOCK_I=block_i,
                EVEN_K=True,
                EVEN_H=True,
                EVEN_I=True,
                FORMAT=fmt,
                PDL=True,
                PREFETCH_LINES=0,
                LINE_ELEMS=64,
                PRELOAD=True,
                **FORMAT_CONSTS[fmt],
            ),
            num_warps=4,
            launch_pdl=True,
        )
        assert "griddepcontrol" in down and gate_up


def expert_centric_compiles(fmt):
    w, s = STORED[fmt]
    consts = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, EVEN_K=True, UPCAST=False, FORMAT=fmt)
    consts.update(FORMAT_CONSTS[fmt])
    common = dict(w_ptr=w, s_ptr=s, sorted_ptr="i32", block_expert_ptr="i32", rows_used_ptr="i32")
    for kernel, pointers in (
        (fused_moe._gate_up_kernel, dict(x_ptr="bf16", out_ptr="bf16")),
        (fused_moe._down_kernel, dict(act_ptr="bf16", out_ptr="bf16", weights_ptr="fp32")),
    ):
        assert "mma" in compile_for_hopper(
            kernel, {**common, **pointers}, consts, num_warps=4, num_stages=3
        )


def skinny_gemv_compiles(fmt):
    w, s = STORED[fmt]
    consts = dict(
        HAS_BIAS=False, BLOCK_N=16, BLOCK_K=128, ROWS=gemv.MAX_ROWS, INTERPRET=False, FORMAT=fmt
    )
    consts.update(FORMAT_CONSTS[fmt])
    assert compile_for_hopper(
        gemv._skinny_kernel,
        dict(x_ptr="bf16", w_ptr=w, s_ptr=s, b_ptr="bf16", y_ptr="bf16"),
        consts,
        num_warps=4,
        num_stages=3,
    )


def main() -> int:
    assert not os.environ.get("TRITON_INTERPRET"), (
        "compiling needs Triton's JIT, not its interpreter"
    )
    for check in (warp_decode_compiles, expert_centric_compiles, skinny_gemv_compiles):
        for fmt in FORMATS:
            check(fmt)
            print(f"{check.__name__.removesuffix('_compiles')} format {fmt}: compiled", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
