"""The int4 warp-decode pair compiled for Hopper (sm90) without a GPU, in the variants the
interpreter cannot vouch for: ragged tiles (masked loads), padded top-k slots, and the down
kernel's first columns (one step's, or four steps') preloaded before the PDL wait.

The PTX must hold no int->float conversion (the values come from a bit trick,
kernels.quant_tiles.int4_plane), and nothing 16-bit — the bf16 activations — may be loaded
before the wait: only the routing and the int32 words can be. Like
test_kernels_compile_for_hopper, the test re-runs this module in a process without the
interpreter: `python -m tests.kernels.test_int4_warp_decode_compiles`.
"""

import os
import re
import sys

INT_TO_FLOAT = re.compile(r"cvt\.rn\.f32\.[su](8|16|32|64)")
LOAD_16 = re.compile(r"ld\.global[.\w]*\.b16")
LOAD_32 = re.compile(r"ld\.global[.\w]*\.b32")


def test_int4_warp_decode_variants_compile_for_hopper():
    from tests.kernels.test_kernels_compile_for_hopper import run_without_interpreter

    run = run_without_interpreter("tests.kernels.test_int4_warp_decode_compiles")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "int4 warp decode: compiled 6 gate/up and 18 down variants" in run.stdout, run.stdout


def compile_int4(kernel: str, pointers: dict, constants: dict) -> str:
    # Imported here: the test process runs with the interpreter, only main() compiles.
    from kernels import warp_decode
    from kernels.quant import INT4_GROUPS
    from tests.kernels.test_kernels_compile_for_hopper import FORMAT_CONSTS, compile_for_hopper

    constants = dict(constants, FORMAT=INT4_GROUPS, **FORMAT_CONSTS[INT4_GROUPS])
    return compile_for_hopper(
        getattr(warp_decode, kernel), pointers, constants, num_warps=4, launch_pdl=True
    )


def gate_up_ptx(even: bool, block_h: int, stages: int = 1) -> str:
    pointers = dict(x_ptr="bf16", w_ptr="i32", s_ptr="bf16", ids_ptr="i64", out_ptr="bf16")
    pointers.update(wdown_ptr="i32")
    constants = dict(BLOCK_I=16, BLOCK_H=block_h, EVEN_I=even, EVEN_H=even, LAUNCH_DEPS=True)
    constants.update(DOWN_LINES=0, LINE_ELEMS=64, EVICT="", PDL=True, LOOP_STAGES=stages)
    return compile_int4("_gate_up_silu_kernel", pointers, constants)


def down_ptx(
    k_pad: int, even: bool, preload: int, routing_ready: bool, stages: int = 1, block_i: int = 128
) -> str:
    pointers = dict(act_ptr="bf16", w_ptr="i32", s_ptr="bf16", ids_ptr="i64", y_ptr="bf16")
    pointers.update(weights_ptr="fp32")
    constants = dict(K_PAD=k_pad, BLOCK_H=8, BLOCK_I=block_i, EVEN_K=even, EVEN_H=even)
    constants.update(EVEN_I=even)
    constants.update(PDL=True, PREFETCH_LINES=0, LINE_ELEMS=64, PRELOAD=preload)
    constants.update(ROUTING_READY=routing_ready, EVEN_PRELOAD=even, LOOP_STAGES=stages)
    return compile_int4("_down_kernel", pointers, constants)


def before_wait(ptx: str) -> str:
    return ptx[: ptx.index("griddepcontrol.wait")]


def main() -> int:
    assert not os.environ.get("TRITON_INTERPRET"), "compiling needs Triton's JIT"
    n_gate_up = n_down = 0
    for even in (True, False):
        # Pipelined loops (loop_stages 3) in the ragged variants too: their async copies are masked.
        # Steps within a group of 128 columns, and of four whole groups (a scale per word).
        for block_h, stages in ((64, 1), (128, 3), (512, 1)):
            ptx = gate_up_ptx(even, block_h, stages)
            assert not INT_TO_FLOAT.search(ptx), INT_TO_FLOAT.search(ptx).group(0)
            assert "ld.global" not in before_wait(ptx) and "cp.async" not in before_wait(ptx)
            assert ("cp.async" in ptx) == (stages > 1)
            n_gate_up += 1
        for k_pad, stages in ((1, 1), (8, 3)):
            early_words = {}
            for preload, routing_ready in ((512, True), (128, True), (0, True), (0, False)):
                ptx = down_ptx(k_pad, even, preload, routing_ready, stages)
                assert not INT_TO_FLOAT.search(ptx), INT_TO_FLOAT.search(ptx).group(0)
                early = before_wait(ptx)
                assert not LOAD_16.search(early), "activations read before the wait"
                assert "cp.async" not in early, "the loop's copies start after the wait"
                early_words[preload, routing_ready] = len(LOAD_32.findall(early))
                if not routing_ready:
                    assert "ld.global" not in early, "a load before the wait races the router"
                assert ("cp.async" in ptx) == (stages > 1)
                n_down += 1
            # The routing weights are 32-bit loads before the wait either way: preloading must add
            # the first step's words to them, and four steps' more.
            assert early_words[512, True] > early_words[128, True] > early_words[0, True], (
                early_words
            )
        # Loop steps of four groups of 128 (a scale per word), pipelined.
        ptx = down_ptx(8, even, 512, True, stages=3, block_i=512)
        assert not INT_TO_FLOAT.search(ptx), INT_TO_FLOAT.search(ptx).group(0)
        assert "cp.async" in ptx and not LOAD_16.search(before_wait(ptx))
        n_down += 1
    print(f"int4 warp decode: compiled {n_gate_up} gate/up and {n_down} down variants")
    return 0


if __name__ == "__main__":
    sys.exit(main())
