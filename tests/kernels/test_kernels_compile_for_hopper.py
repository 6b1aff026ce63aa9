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

from kernels import fused_moe, fused_ops, gemv, warp_decode
from kernels.quant import FP8_BLOCKS, INT4_GROUPS, PLAIN

HOPPER = GPUTarget("cuda", 90, 32)
# The stored weight's and its scales' pointer types, per format.
STORED = {PLAIN: ("bf16", "bf16"), FP8_BLOCKS: ("u8", "fp32"), INT4_GROUPS: ("i32", "bf16")}
FORMAT_CONSTS = {
    PLAIN: dict(SCALE_ROWS=1, SCALE_COLS=1, PER_ITEM=1),
    FP8_BLOCKS: dict(SCALE_ROWS=128, SCALE_COLS=128, PER_ITEM=1),
    INT4_GROUPS: dict(SCALE_ROWS=1, SCALE_COLS=128, PER_ITEM=8),
}


def compile_for_hopper(
    kernel, pointers: dict, constants: dict, scalars=None, divisible=(), **options
):
    """PTX of `kernel` with these pointer element types, constexprs and scalar types (`scalars`,
    e.g. an fp32 eps); other args are i32. `divisible`: integer args known to be multiples of 16,
    as Triton's JIT specializes them at a launch (strides of contiguous tensors): what lets it
    vectorize and pipeline loads."""
    scalars = scalars or {}
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = scalars.get(name, "i32")
    aligned = {
        (kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in (*pointers, *divisible)
    }
    compiled = triton.compile(
        ASTSource(kernel, signature, constants, aligned), target=HOPPER, options=options
    )
    return compiled.asm["ptx"]


FORMATS = [PLAIN, FP8_BLOCKS, INT4_GROUPS]
ROOT = Path(__file__).resolve().parents[2]


def run_without_interpreter(module: str) -> subprocess.CompletedProcess:
    """`python -m module` with Triton's JIT (the test process may run under the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", module],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_every_kernel_compiles_for_hopper():
    run = run_without_interpreter("tests.kernels.test_kernels_compile_for_hopper")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.count("compiled") == 4 * len(FORMATS), run.stdout
    assert "norm_route: built" in run.stdout, run.stdout
    assert "qk norm rope store: built" in run.stdout, run.stdout
    assert "paged attention split and merge: built" in run.stdout, run.stdout
    assert "add rms norm: built" in run.stdout, run.stdout
    assert "one-pass dequantize: built" in run.stdout, run.stdout


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
                PDL=True,
                LOOP_STAGES=3,
                **FORMAT_CONSTS[fmt],
            ),
            divisible=("hidden", "inter", "stride_xt", "stride_we", "stride_wn", "stride_wde"),
            num_warps=4,
            launch_pdl=True,
        )
        # Routing known before kernel 1 (two steps' weights preloaded before the wait), and the
        # router a link of the chain (nothing read before the wait).
        for routing_ready in (True, False):
            down = compile_for_hopper(
                warp_decode._down_kernel,
                dict(
                    act_ptr="bf16",
                    w_ptr=w,
                    s_ptr=s,
                    ids_ptr="i64",
                    weights_ptr="fp32",
                    y_ptr="bf16",
                ),
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
                    PRELOAD=2 * block_i if routing_ready else 0,
                    EVEN_PRELOAD=True,
                    ROUTING_READY=routing_ready,
                    LOOP_STAGES=3,
                    **FORMAT_CONSTS[fmt],
                ),
                divisible=("hidden", "inter", "stride_we", "stride_wh", "stride_yt"),
                num_warps=4,
                launch_pdl=True,
            )
            assert "griddepcontrol.wait" in down and "griddepcontrol" in gate_up
            # Later loop steps' weights are in flight as async copies (loop_stages), and the
            # weights come in 16-byte vectors where the strides allow (int4 words: 4 bytes).
            assert "cp.async.cg.shared.global" in gate_up + down
            assert "cp.async" in gate_up and "cp.async" in down
            if not routing_ready:
                assert down.index("griddepcontrol.wait") < down.index("ld.global"), (
                    "a load before the wait races the router"
                )
        assert gate_up.index("griddepcontrol.wait") < gate_up.index("ld.global")


def persistent_warp_decode_compiles(fmt):
    """Both kernels' items in one launch: tickets and counts by atomics, the down items' wait an
    acquire load, the activations they read written during the launch, so read from L2."""
    w, s = STORED[fmt]
    pointers = dict(x_ptr="bf16", gu_ptr=w, gu_s_ptr=s, ids_ptr="i64", weights_ptr="fp32")
    pointers.update(act_ptr="bf16", dn_ptr=w, dn_s_ptr=s, y_ptr="bf16", counters_ptr="i32")
    scales = FORMAT_CONSTS[fmt]
    consts = dict(G_BLOCK_I=8, G_BLOCK_H=128, G_EVEN_I=True, G_EVEN_H=True, G_LOOP_STAGES=3)
    consts.update(G_SCALE_ROWS=scales["SCALE_ROWS"], G_SCALE_COLS=scales["SCALE_COLS"])
    consts.update(K_PAD=8, D_BLOCK_H=8, D_BLOCK_I=128, EVEN_K=True, D_EVEN_H=True, D_EVEN_I=True)
    consts.update(D_SCALE_ROWS=scales["SCALE_ROWS"], D_SCALE_COLS=scales["SCALE_COLS"])
    consts.update(PRELOAD=128, EVEN_PRELOAD=True, D_LOOP_STAGES=3, FORMAT=fmt)
    consts.update(PER_ITEM=scales["PER_ITEM"], BLOCK_T=64, PDL=True)
    ptx = compile_for_hopper(
        warp_decode._persistent_kernel,
        pointers,
        consts,
        divisible=(
            "hidden",
            "inter",
            "stride_xt",
            "stride_gue",
            "stride_gun",
            "stride_dne",
            "stride_dnh",
            "stride_yt",
        ),  # fmt: skip
        num_warps=4,
        launch_pdl=True,
    )
    assert "atom.global.gpu.release.add" in ptx and "atom.global.gpu.acq_rel.add" in ptx
    assert "ld.global.gpu.acquire" in ptx and "ld.global.cg" in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("atom.global")
    # With the strides the JIT specializes, the weights come as 16-byte async copies, not
    # element by element (bf16 and FP8; int4's scales are single bf16 loads by design).
    assert "cp.async.cg.shared.global" in ptx
    if fmt != INT4_GROUPS:
        assert ptx.count("ld.global.b16") + ptx.count("ld.global.u8") < 4


def expert_centric_compiles(fmt):
    """A decode batch's tiles, and a prompt chunk's (FP8 with its block scales on the weights
    too, the option engine.bench.prefill_moe sweeps)."""
    w, s = STORED[fmt]
    common = dict(w_ptr=w, s_ptr=s, sorted_ptr="i32", block_expert_ptr="i32", rows_used_ptr="i32")
    tiles = [(16, 64, 128, 4, 3, False), (64, 128, 64, 8, 4, False)]
    if fmt == FP8_BLOCKS:
        tiles.append((64, 128, 64, 8, 4, True))
    for block_m, block_n, block_k, warps, stages, scale_weights in tiles:
        consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=True)
        consts.update(UPCAST=False, FORMAT=fmt, SCALE_WEIGHTS=scale_weights)
        consts.update(FORMAT_CONSTS[fmt])
        for kernel, pointers in (
            (fused_moe._gate_up_kernel, dict(x_ptr="bf16", out_ptr="bf16")),
            (fused_moe._down_kernel, dict(act_ptr="bf16", out_ptr="bf16", weights_ptr="fp32")),
        ):
            assert "mma" in compile_for_hopper(
                kernel, {**common, **pointers}, consts, num_warps=warps, num_stages=stages
            )


def skinny_gemv_compiles(fmt):
    """The plain GEMV, and the one with the residual add + RMSNorm prologue in a PDL chain with
    K split (its last part adds the partials)."""
    w, s = STORED[fmt]
    pointers = dict(x_ptr="bf16", delta_ptr="bf16", nw_ptr="bf16", sum_ptr="bf16")
    pointers.update(w_ptr=w, s_ptr=s, b_ptr="bf16", y_ptr="bf16", part_ptr="fp32")
    pointers.update(counters_ptr="i32")
    cases = [(False, False, 1, False), (True, True, 4, False)]
    if fmt:  # a quantized weight's scales on its values, too
        cases.append((False, False, 1, True))
    for norm, pdl, split_k, scale_weights in cases:
        consts = dict(HAS_BIAS=False, NORM=norm, HAS_DELTA=norm, BLOCK_N=16, BLOCK_K=128)
        consts.update(ROWS=gemv.MAX_ROWS, INTERPRET=False, FORMAT=fmt, PDL=pdl, SPLIT_K=split_k)
        consts.update(SCALE_WEIGHTS=scale_weights, HEAD_DIM=0, HALF=0, NORM_BLOCK=2048)
        consts.update(FORMAT_CONSTS[fmt])
        ptx = compile_for_hopper(
            gemv._skinny_kernel,
            pointers,
            consts,
            scalars=dict(eps="fp32", head_eps="fp32"),
            num_warps=4,
            num_stages=3,
            launch_pdl=pdl,
        )
        assert ("griddepcontrol" in ptx) == pdl
        assert ("atom.global" in ptx) == (split_k > 1)
        if pdl:  # no store or arrival before the predecessor is done
            assert ptx.index("griddepcontrol.wait") < ptx.index("st.global")
        if pdl and split_k > 1:
            assert ptx.index("griddepcontrol.wait") < ptx.index("atom.global")
    heads_gemv_compiles(fmt)


def heads_gemv_compiles(fmt):
    """The q/k/v GEMV with the attention inputs as its epilogue, in a PDL chain with K split:
    nothing stored and no arrival counted before the predecessor is done."""
    w, s = STORED[fmt]
    pointers = dict(x_ptr="bf16", delta_ptr="bf16", nw_ptr="bf16", sum_ptr="bf16")
    pointers.update(w_ptr=w, s_ptr=s, b_ptr="bf16", y_ptr="bf16", part_ptr="fp32")
    pointers.update(counters_ptr="i32", qw_ptr="bf16", kw_ptr="bf16", cos_ptr="bf16")
    pointers.update(sin_ptr="bf16")
    pointers.update(q_out_ptr="bf16", k_dst_ptr="bf16", v_dst_ptr="bf16", slots_ptr="i64")
    consts = dict(HAS_BIAS=False, NORM=False, HAS_DELTA=False, BLOCK_N=32, BLOCK_K=128)
    consts.update(ROWS=16, INTERPRET=False, FORMAT=fmt, PDL=True, SPLIT_K=4)
    consts.update(SCALE_WEIGHTS=False, HEAD_DIM=128, HALF=64, NORM_BLOCK=1)
    consts.update(FORMAT_CONSTS[fmt])
    ptx = compile_for_hopper(
        gemv._skinny_kernel,
        pointers,
        consts,
        scalars=dict(eps="fp32", head_eps="fp32"),
        num_warps=4,
        num_stages=3,
        launch_pdl=True,
    )
    assert ptx.index("griddepcontrol.wait") < ptx.index("st.global")
    assert ptx.index("griddepcontrol.wait") < ptx.index("atom.global")


def qk_norm_rope_store_compiles():
    """The decode step's q/k RMSNorm + RoPE + KV store in a PDL chain (an fp8 pool gets its k/v
    through a bf16 scratch, so the destinations are bf16 in the step; fp8 must compile too)."""
    for kv in ("bf16", "fp8e4nv"):
        pointers = dict(qkv_ptr="bf16", qw_ptr="bf16", kw_ptr="bf16", cos_ptr="fp32")
        pointers.update(sin_ptr="fp32", q_out_ptr="bf16", k_dst_ptr=kv, v_dst_ptr=kv)
        pointers.update(slots_ptr="i64")
        ptx = compile_for_hopper(
            fused_ops._qk_norm_rope_store_kernel,
            pointers,
            dict(HEAD_DIM=128, HALF=64, PDL=True),
            scalars=dict(eps="fp32"),
            num_warps=1,
            launch_pdl=True,
        )
        assert "griddepcontrol" in ptx


def add_rms_norm_compiles():
    """The residual add + RMSNorm in a PDL chain: only its weight is read before the wait, and
    nothing is stored before it."""
    pointers = dict(x_ptr="bf16", delta_ptr="bf16", w_ptr="bf16", sum_ptr="bf16", out_ptr="bf16")
    ptx = compile_for_hopper(
        fused_ops._add_rms_norm_kernel,
        pointers,
        dict(HAS_DELTA=True, BLOCK=2048, PDL=True),
        scalars=dict(eps="fp32"),
        divisible=("hidden",),
        num_warps=8,
        launch_pdl=True,
    )
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.launch_dependents") < wait
    # The weight, x and delta rows are read in as many loads each: a third before the wait.
    assert 3 * ptx[:wait].count("ld.global") == ptx.count("ld.global") > 0
    assert wait < ptx.index("st.global")


def paged_attention_fused_merge_compiles():
    """The split kernel, one launch (the last split program of a (sequence, kv head) merges) or
    followed by the merge kernel, with bf16 and fp8 storage, in a PDL chain: the merge reads
    nothing before its wait, and neither kernel stores anything before it."""
    from kernels import paged_attention

    for kv, fp8, fused in (("bf16", False, True), ("fp8e4nv", True, True), ("bf16", False, False)):
        ptx = compile_for_hopper(
            paged_attention._split_kernel,
            dict(
                q_ptr="bf16",
                k_ptr=kv,
                v_ptr=kv,
                ks_ptr="fp32",
                vs_ptr="fp32",
                table_ptr="i32",
                lens_ptr="i32",
                m_ptr="fp32",
                l_ptr="fp32",
                acc_ptr="fp32",
                out_ptr="bf16",
                counters_ptr="i32",
            ),
            dict(
                GROUP=8,
                GROUP_PAD=16,
                HEAD_DIM=128,
                D_PAD=128,
                SPLIT_PAD=16,
                BLOCK_SIZE=16,
                TILE=64,
                FP8=fp8,
                FUSED_MERGE=fused,
                DIRECT=False,
                PDL=True,
                INTERPRET=False,
            ),
            num_warps=4,
            launch_pdl=True,
        )
        assert "griddepcontrol" in ptx and ("atom" in ptx) == fused and "mma" in ptx
        # The lengths, tables and first tile of keys are read before the wait; nothing is
        # stored, and no arrival counted, until it.
        wait = ptx.index("griddepcontrol.wait")
        assert ptx.index("griddepcontrol.launch_dependents") < wait
        assert ptx.index("ld.global") < wait
        for access in ("st.global", "atom."):
            assert access not in ptx or wait < ptx.index(access), access
    merge = compile_for_hopper(
        paged_attention._merge_kernel,
        dict(m_ptr="fp32", l_ptr="fp32", acc_ptr="fp32", out_ptr="bf16"),
        dict(HEAD_DIM=128, D_PAD=128, SPLIT_PAD=16, PDL=True),
        num_warps=4,
        launch_pdl=True,
    )
    _assert_waits_first(merge)


def _assert_waits_first(ptx: str) -> None:
    """A link of a PDL chain: it lets the next kernel start, then waits, before any global
    load or store."""
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.launch_dependents") < wait
    for access in ("ld.global", "st.global"):
        assert access not in ptx or wait < ptx.index(access), access


def norm_route_compiles():
    """The decode step's fused router (kernels.router.norm_route): bf16, in a PDL chain."""
    from kernels.router import _norm_route_kernel as kernel

    pointers = dict(x_ptr="bf16", delta_ptr="bf16", norm_w_ptr="bf16", router_ptr="bf16")
    pointers.update(sum_ptr="bf16", h_ptr="bf16", logits_ptr="fp32", counters_ptr="i32")
    pointers.update(ids_ptr="i64", weights_ptr="fp32")
    consts = dict(HAS_DELTA=True, BLOCK_H=2048, BLOCK_E=8, TOP_K=8, K_PAD=8, E_PAD=128)
    consts.update(RENORMALIZE=True, PDL=True)
    scalars = dict(hidden="i32", n_experts="i32", eps="fp32")
    signature = {n: "constexpr" if n in consts else scalars.get(n) for n in kernel.arg_names}
    signature.update({n: "*" + ty for n, ty in pointers.items()})
    aligned = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    ptx = triton.compile(
        ASTSource(kernel, signature, consts, aligned),
        target=HOPPER,
        options=dict(num_warps=8, launch_pdl=True),
    ).asm["ptx"]
    assert "griddepcontrol" in ptx and "atom" in ptx


def dequantize_compiles():
    """The one-pass dequantize (kernels.dequantize) of FP8 blocks and int4 groups to bf16."""
    from kernels.dequantize import _dequantize_kernel, tile

    for fmt in (FP8_BLOCKS, INT4_GROUPS):
        w, s = STORED[fmt]
        block_n, block_k = tile(FORMAT_CONSTS[fmt]["SCALE_COLS"])
        ptx = compile_for_hopper(
            _dequantize_kernel,
            dict(w_ptr=w, s_ptr=s, out_ptr="bf16"),
            dict(FORMAT=fmt, BLOCK_N=block_n, BLOCK_K=block_k, **FORMAT_CONSTS[fmt]),
            divisible=("n_rows", "n_cols", "stride_wn", "stride_on"),
            num_warps=4,
        )
        assert "ld.global" in ptx and "st.global" in ptx


def main() -> int:
    assert not os.environ.get("TRITON_INTERPRET"), (
        "compiling needs Triton's JIT, not its interpreter"
    )
    for check in (
        warp_decode_compiles,
        persistent_warp_decode_compiles,
        expert_centric_compiles,
        skinny_gemv_compiles,
    ):
        for fmt in FORMATS:
            check(fmt)
            print(f"{check.__name__.removesuffix('_compiles')} format {fmt}: compiled", flush=True)
    norm_route_compiles()
    print("norm_route: built", flush=True)
    qk_norm_rope_store_compiles()
    print("qk norm rope store: built", flush=True)
    paged_attention_fused_merge_compiles()
    print("paged attention split and merge: built", flush=True)
    add_rms_norm_compiles()
    print("add rms norm: built", flush=True)
    dequantize_compiles()
    print("one-pass dequantize: built", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
