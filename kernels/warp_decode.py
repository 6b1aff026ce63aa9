"""Warp decode: MoE decoding organised around outputs instead of experts.

Two launches and nothing else — no sort, pad, scatter, combine or activation quantisation:

1. `_gate_up_silu_kernel`, one program per (token, routed slot, block of intermediate neurons):
   streams that expert's gate and up rows over H with fp32 accumulation and writes
   `silu(gate) * up` (activation dtype) into a [T*k, I] intermediate.
2. `_down_kernel`, one program per (token, block of hidden outputs): streams the down rows of
   all the token's top-k experts at once (the slot is a tile dimension, so k experts' loads are
   in flight together), folds each routing weight into the fp32 accumulator and writes once.

On Hopper and later the pair can overlap (config `"pdl"`): kernel 2 is launched with
programmatic dependent launch, kernel 1 lets it start as soon as every kernel-1 program is
running, and kernel 2 loads the first columns of its down rows (`"preload"`: one step's, or
more) before it waits for kernel 1's activations. Those rows depend only on the routing,
which is complete before kernel 1 starts, so part of kernel 2's weight traffic overlaps
kernel 1's tail. (An L2 prefetch of all its rows, `"prefetch"`, and kernel 1 prefetching them,
`"prefetch_down"`, were measured slower; the tuner keeps them as candidates.)

Both kernels run the work items of `kernels.warp_decode_items`, one item a program. The same
items can also run in one launch (config `"persistent"`: `_persistent_kernel`, a few programs per
SM taking every gate/up item, then every down item, each down item waiting on a per-token count
of its token's gate/up items): one ramp and one tail a layer instead of two. It has measured
slower than the pair everywhere so far (BENCHMARKS.md, "Pipelined loops and one persistent
launch"); the tuner keeps trying it.

Work grows with T*k expert-row reads, so this is the decode path; `kernels.dispatch` switches
to the expert-centric path (`kernels.fused_moe`) where that is measured to be faster.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import tuned
from kernels.counters import sm_count, zeroed_counters
from kernels.moe_inputs import moe_inputs
from kernels.pdl import launch_dependents, pdl_supported, wait
from kernels.quant import (
    PLAIN,
    KernelWeight,
    Weight,
    format_name,
    is_quantized,
    kernel_weight,
    scale_tile,
)
from kernels.triton_env import interpreting, next_pow2
from kernels.warp_decode_items import (
    ACTS_COUNTED,
    ACTS_PDL,
    ACTS_READY,
    down_item,
    gate_up_item,
    prefetch_l2,
)

# Values of one down-kernel step's tile (k_pad * block_h * block_i): past this the tile spills
# registers. A preload is held to as many stored items (int4: words, which it keeps packed
# across the wait), see preload_cols.
DOWN_TILE_BUDGET = 16384
L2_LINE_BYTES = 128


def use_pdl(cfg: dict, device: torch.device) -> bool:
    return bool(cfg.get("pdl")) and pdl_supported(device)


@triton.jit(do_not_specialize=["n_slots"])
def _gate_up_silu_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    ids_ptr,
    out_ptr,
    wdown_ptr,
    n_slots,
    hidden,
    inter,
    top_k,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_wde,
    down_lines,
    BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_I: tl.constexpr,
    EVEN_H: tl.constexpr,
    FORMAT: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    PER_ITEM: tl.constexpr,
    LAUNCH_DEPS: tl.constexpr,
    DOWN_LINES: tl.constexpr,
    LINE_ELEMS: tl.constexpr,
    EVICT: tl.constexpr,
    PDL: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    if LAUNCH_DEPS:  # kernel 2 may be scheduled once every program here has started
        tl.extra.cuda.gdc_launch_dependents()
    wait(PDL)  # a link of the decode step's chain: the routing and x come from before
    pid_i = tl.program_id(1)
    expert = gate_up_item(
        x_ptr, w_ptr, s_ptr, ids_ptr, out_ptr, tl.program_id(0), pid_i, hidden, inter, top_k,
        stride_xt, stride_we, stride_wn, stride_se, stride_sn,
        BLOCK_I, BLOCK_H, EVEN_I, EVEN_H, FORMAT, SCALE_ROWS, SCALE_COLS, PER_ITEM, EVICT,
        LOOP_STAGES,
    )  # fmt: skip
    if DOWN_LINES > 0:
        # This program's share of the expert's down matrix, pulled into L2 (kept there) while
        # the rest of the launch streams gate/up, so kernel 2 reads it from L2.
        chunk = tl.cdiv(down_lines, tl.num_programs(1))
        lines = tl.minimum(
            pid_i * chunk + tl.minimum(tl.arange(0, DOWN_LINES), chunk - 1), down_lines - 1
        )
        prefetch_l2(
            wdown_ptr + expert * stride_wde + lines.to(tl.int64) * LINE_ELEMS, EVICT_LAST=True
        )


@triton.jit(do_not_specialize=["n_tokens"])
def _down_kernel(
    act_ptr,
    w_ptr,
    s_ptr,
    ids_ptr,
    weights_ptr,
    y_ptr,
    n_tokens,
    hidden,
    inter,
    top_k,
    stride_we,
    stride_wh,
    stride_se,
    stride_sh,
    stride_yt,
    K_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_I: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_H: tl.constexpr,
    EVEN_I: tl.constexpr,
    FORMAT: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    PER_ITEM: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    LINE_ELEMS: tl.constexpr,
    PRELOAD: tl.constexpr,
    EVEN_PRELOAD: tl.constexpr,
    ROUTING_READY: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    launch_dependents(PDL)  # the next kernel of a PDL chain may start during this one's tail
    if not ROUTING_READY:
        # The router is a link of the chain too: kernel 1 may have started (and so this one)
        # before the routing was written. Nothing of it may be read before the wait.
        wait(PDL)
    down_item(
        act_ptr, w_ptr, s_ptr, ids_ptr, weights_ptr, y_ptr, tl.program_id(0), tl.program_id(1),
        hidden, inter, top_k, stride_we, stride_wh, stride_se, stride_sh, stride_yt,
        y_ptr, 0,  # ready_ptr, ready_count: unused, the activations are ready or PDL-awaited
        K_PAD, BLOCK_H, BLOCK_I, EVEN_K, EVEN_H, EVEN_I, FORMAT, SCALE_ROWS, SCALE_COLS, PER_ITEM,
        PREFETCH_LINES, LINE_ELEMS, PRELOAD, EVEN_PRELOAD,
        ACTS_PDL if PDL and ROUTING_READY else ACTS_READY, LOOP_STAGES,
    )  # fmt: skip


@triton.jit(do_not_specialize=["n_tokens"])
def _persistent_kernel(
    x_ptr,
    gu_ptr,
    gu_s_ptr,
    ids_ptr,
    weights_ptr,
    act_ptr,
    dn_ptr,
    dn_s_ptr,
    y_ptr,
    counters_ptr,
    n_tokens,
    hidden,
    inter,
    top_k,
    n_i,
    n_h,
    stride_xt,
    stride_gue,
    stride_gun,
    stride_guse,
    stride_gusn,
    stride_dne,
    stride_dnh,
    stride_dnse,
    stride_dnsh,
    stride_yt,
    G_BLOCK_I: tl.constexpr,
    G_BLOCK_H: tl.constexpr,
    G_EVEN_I: tl.constexpr,
    G_EVEN_H: tl.constexpr,
    G_SCALE_ROWS: tl.constexpr,
    G_SCALE_COLS: tl.constexpr,
    G_LOOP_STAGES: tl.constexpr,
    K_PAD: tl.constexpr,
    D_BLOCK_H: tl.constexpr,
    D_BLOCK_I: tl.constexpr,
    EVEN_K: tl.constexpr,
    D_EVEN_H: tl.constexpr,
    D_EVEN_I: tl.constexpr,
    D_SCALE_ROWS: tl.constexpr,
    D_SCALE_COLS: tl.constexpr,
    PRELOAD: tl.constexpr,
    EVEN_PRELOAD: tl.constexpr,
    D_LOOP_STAGES: tl.constexpr,
    FORMAT: tl.constexpr,
    PER_ITEM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr,
):
    """Both kernels' work items from one launch of a few programs per SM, each taking tickets
    in order: every gate/up item (slot-major), then every down item (token-major). A down item
    loads its first weights, then waits until its token's gate/up items are counted done; those
    items hold lower tickets, so programs that are running hold them and no wait can deadlock.
    One ramp and one tail a layer instead of two. counters_ptr: [next ticket, programs done,
    done gate/up items per token], zero at launch and left at zero."""
    launch_dependents(PDL)
    wait(PDL)  # x and the routing come from before (and so does the counters' reset)
    n_gate = n_tokens * top_k * n_i
    n_items = n_gate + n_tokens * n_h
    done_ptr = counters_ptr + 2
    ticket = tl.atomic_add(counters_ptr, 1)
    while ticket < n_items:
        if ticket < n_gate:
            slot = ticket // n_i
            gate_up_item(
                x_ptr, gu_ptr, gu_s_ptr, ids_ptr, act_ptr, slot, ticket % n_i, hidden, inter,
                top_k, stride_xt, stride_gue, stride_gun, stride_guse, stride_gusn,
                G_BLOCK_I, G_BLOCK_H, G_EVEN_I, G_EVEN_H, FORMAT, G_SCALE_ROWS, G_SCALE_COLS,
                PER_ITEM, "", G_LOOP_STAGES,
            )  # fmt: skip
            tl.debug_barrier()  # every thread's activations stored before the count says so
            tl.atomic_add(done_ptr + slot // top_k, 1, sem="release")
        else:
            item = ticket - n_gate
            down_item(
                act_ptr, dn_ptr, dn_s_ptr, ids_ptr, weights_ptr, y_ptr, item // n_h, item % n_h,
                hidden, inter, top_k, stride_dne, stride_dnh, stride_dnse, stride_dnsh,
                stride_yt, done_ptr, top_k * n_i, K_PAD, D_BLOCK_H, D_BLOCK_I, EVEN_K, D_EVEN_H,
                D_EVEN_I, FORMAT, D_SCALE_ROWS, D_SCALE_COLS, PER_ITEM, 0, 1, PRELOAD,
                EVEN_PRELOAD, ACTS_COUNTED, D_LOOP_STAGES,
            )  # fmt: skip
        ticket = tl.atomic_add(counters_ptr, 1)
    # The last program out (every ticket taken, every item finished) resets the counters.
    tl.debug_barrier()
    if tl.atomic_add(counters_ptr + 1, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        for t0 in range(0, n_tokens, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            tl.store(done_ptr + offs_t, tl.zeros([BLOCK_T], tl.int32), mask=offs_t < n_tokens)
        tl.store(counters_ptr, 0)
        tl.store(counters_ptr + 1, 0)


def preload_cols(preload, block_i: int, inter: int, tile_rows: int, w: KernelWeight) -> int:
    """Columns of down rows kernel 2 loads before its PDL wait: cfg "preload" True is the first
    step's (block_i), a number that many columns rounded up to a power of two, at least block_i
    and at most the row's power of two (the columns past the row masked) or what keeps the
    preloaded tile (tile_rows = k_pad * block_h rows, w.per_item columns an item) within
    DOWN_TILE_BUDGET; 0 for none. Narrower than an int4 group, it must divide the group (one
    scale a row): else it is the first step's."""
    if not preload:
        return 0
    cols = block_i if preload is True else next_pow2(int(preload))
    budget = 1 << max(0, (DOWN_TILE_BUDGET * w.per_item // tile_rows).bit_length() - 1)
    cols = max(block_i, min(cols, next_pow2(inter), budget))
    return block_i if cols < w.tile_cols and w.tile_cols % cols else cols


# "loop_stages": how many steps of a kernel's loop have their weights in flight at once (Triton's
# per-loop pipelining: the loads of later steps are issued as async copies to shared memory while
# this step computes). 1 is no pipelining: a program then waits for each step's loads in turn.
DEFAULT_GATE_UP = {"BLOCK_I": 16, "BLOCK_H": 256, "num_warps": 4}
# "pdl": overlap with kernel 1 where supported; "prefetch": L2 prefetch of the down rows first;
# "preload": down rows loaded into registers before waiting for kernel 1 (True: the first step's
# columns; a number: that many columns, see preload_cols).
DEFAULT_DOWN = {"BLOCK_H": 8, "BLOCK_I": 128, "num_warps": 4, "pdl": False, "prefetch": False}


def default_configs(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, weights: str = "bf16"
) -> dict:
    """Tuned configs for this shape, weight format (kernels.quant.format_name) and batch if the
    repo has them, else the defaults."""
    kernel = "warp_decode" if weights == "bf16" else f"warp_decode_{weights}"
    table = tuned.load(tuned.shape_name(kernel, hidden, inter, experts, top_k)) or {}
    cfg = {
        "gate_up": tuned.nearest(table.get("gate_up"), tokens) or DEFAULT_GATE_UP,
        "down": tuned.nearest(table.get("down"), tokens) or DEFAULT_DOWN,
    }
    # The one-launch form (persistent_moe) only where it was chosen for the batch whose tiles
    # these are: a batch the tuner never timed it at runs the pair. 0 or absent: the pair.
    persistent = table.get("persistent", {}).get(tuned.nearest_key(table.get("down"), tokens), 0)
    if persistent:
        cfg["persistent"] = persistent
    return cfg


def _fit(block: int, size: int) -> int:
    """Clamp a block to the (power-of-two-rounded) size so tiny dims don't waste lanes."""
    return max(1, min(block, next_pow2(size)))


def warp_decode_moe(
    x: torch.Tensor,
    w_gate_up: Weight,
    w_down: Weight,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: dict | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """MoE layer by warp decode (output-centric); returns y [T, H] in x's dtype.

    x [T, H] bf16 (or fp16/fp32); w_gate_up [E, 2I, H] with the I gate rows first, then the I up
    rows; w_down [E, H, I]; topk_ids [T, k] int (int32 or int64); topk_weights [T, k] fp32.
    The weights are tensors in x's dtype or quantized (kernels.quant: FP8 blocks, int4 groups),
    read as stored and dequantized in registers.
    y[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, j],
    with fp32 accumulation throughout; the only rounding between input and output is the
    intermediate silu(gate)*up stored in x's dtype between the two launches.
    `config` ({"gate_up": {...}, "down": {...}}) overrides the tuned block sizes (used by tuning);
    with "persistent" (programs per SM) both kernels' work runs in one launch (persistent_moe).
    `pdl`: the pair is a link of a PDL chain (kernels.pdl): kernel 1 waits for the kernel before
    it, kernel 2 lets the kernel after it start early.
    """
    x, w_gate_up, w_down, ids, route_w, n_tokens, hidden, inter, experts, top_k = moe_inputs(
        x, w_gate_up, w_down, topk_ids, topk_weights
    )
    cfg = config or default_configs(n_tokens, hidden, inter, experts, top_k, format_name(w_down))
    if n_tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=x.device)
    chain = pdl and pdl_supported(x.device)
    if cfg.get("persistent"):
        return persistent_moe(x, w_gate_up, w_down, ids, route_w, cfg, pdl=chain)
    pdl = chain or use_pdl(cfg["down"], x.device)
    act = gate_up_silu(x, w_gate_up, ids, cfg["gate_up"], launch_deps=pdl, w_down=w_down, pdl=chain)
    return down(act, w_down, ids, route_w, dict(cfg["down"], pdl=pdl), routing_ready=not chain)


def gate_up_silu(
    x, w_gate_up: Weight, ids, cfg: dict, launch_deps: bool = False, w_down=None, pdl=False
) -> torch.Tensor:
    """Kernel 1: act [T*k, I] = silu(gate) * up of each routed slot, in x's dtype.

    cfg["prefetch_down"] (GPU only, needs `w_down`, unquantized weights): each program also
    pulls a share of its expert's down matrix into L2, and gate/up loads are marked evict-first
    so it stays there. Only worth it while the routed down matrices fit in L2 (a token or two).
    """
    n_tokens, hidden = x.shape
    inter = w_gate_up.shape[1] // 2
    top_k = ids.shape[1]
    w = kernel_weight(w_gate_up)
    act = torch.empty(n_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    block_i, block_h = gate_up_launch_tiles(cfg, w, hidden, inter)
    n_i = triton.cdiv(inter, block_i)
    line_elems = max(1, L2_LINE_BYTES // x.element_size())
    prefetch = (
        bool(cfg.get("prefetch_down"))
        and w_down is not None
        and w.format == PLAIN
        and not is_quantized(w_down)
        and x.is_cuda
        and not interpreting()
    )
    down_lines = triton.cdiv(hidden * inter, line_elems) if prefetch else 0
    _gate_up_silu_kernel[(n_tokens * top_k, n_i)](
        x,
        w.stored,
        w.scale,
        ids,
        act,
        w_down if prefetch else w.stored,
        n_tokens * top_k,
        hidden,
        inter,
        top_k,
        x.stride(0),
        w.stored.stride(0),
        w.stored.stride(1),
        w.scale.stride(0),
        w.scale.stride(1),
        w_down.stride(0) if prefetch else 0,
        down_lines,
        BLOCK_I=block_i,
        BLOCK_H=block_h,
        EVEN_I=inter % block_i == 0,
        EVEN_H=hidden % block_h == 0,
        FORMAT=w.format,
        SCALE_ROWS=w.scale_rows,
        SCALE_COLS=w.scale_cols,
        PER_ITEM=w.per_item,
        LAUNCH_DEPS=launch_deps,
        DOWN_LINES=next_pow2(triton.cdiv(down_lines, n_i)) if prefetch else 0,
        LINE_ELEMS=line_elems,
        EVICT="evict_first" if prefetch else "",
        PDL=pdl,
        LOOP_STAGES=cfg.get("loop_stages", 1),
        **_launch_opts(cfg, pdl),
    )
    return act


def gate_up_launch_tiles(cfg: dict, w, hidden: int, inter: int) -> tuple[int, int]:
    """Kernel 1's (BLOCK_I, BLOCK_H) for weight w: a tile never straddles two FP8 blocks' rows,
    its steps lie within an int4 group or span whole ones (KernelWeight.warp_tile_cols). Up rows
    start at row `inter`: a tile must not straddle a block there either."""
    block_i = scale_tile(_fit(cfg["BLOCK_I"], inter), math.gcd(w.scale_rows, inter))
    return block_i, w.warp_tile_cols(_fit(cfg["BLOCK_H"], hidden))


def down_launch_tiles(cfg: dict, w, hidden: int, inter: int, top_k: int) -> tuple[int, int, int]:
    """Kernel 2's (K_PAD, BLOCK_H, BLOCK_I) for weight w: the slots padded to a power of two,
    the [K_PAD, BLOCK_H, BLOCK_I] tile kept within DOWN_TILE_BUDGET."""
    k_pad = next_pow2(top_k)
    block_h = scale_tile(_fit(cfg["BLOCK_H"], hidden), w.scale_rows)
    block_i = _fit(cfg["BLOCK_I"], inter)
    while k_pad * block_h * block_i > DOWN_TILE_BUDGET and block_i > 16:
        block_i //= 2  # many experts per token: keep the 3-D tile in registers
    return k_pad, block_h, w.warp_tile_cols(block_i)


def _launch_opts(cfg: dict, pdl: bool = False) -> dict:
    opts = {"num_warps": cfg["num_warps"]}
    if "num_stages" in cfg and not interpreting():
        opts["num_stages"] = cfg["num_stages"]
    if pdl:
        opts["launch_pdl"] = True
    return opts


def down(act, w_down: Weight, ids, route_w, cfg: dict, routing_ready: bool = True) -> torch.Tensor:
    """Kernel 2: y [T, H] = sum over the token's slots of route_w * (w_down[e] @ act[slot]).

    With cfg["pdl"] (where supported) this must be launched right after the kernel that writes
    `act`, with nothing else between that the activations depend on: it waits only for that one.
    `routing_ready`: ids and route_w were complete before kernel 1 was launched, so they (and
    the first weights they select) are read before the wait; False where the router is itself a
    link of the PDL chain, and everything waits.
    """
    n_tokens, top_k = ids.shape
    experts, hidden, inter = w_down.shape
    w = kernel_weight(w_down)
    y = torch.empty(n_tokens, hidden, dtype=act.dtype, device=act.device)
    k_pad, block_h, block_i = down_launch_tiles(cfg, w, hidden, inter, top_k)
    pdl = use_pdl(cfg, act.device)
    line_elems = max(1, L2_LINE_BYTES // w.stored.element_size())
    prefetch = pdl and routing_ready and cfg.get("prefetch") and w.format == PLAIN
    prefetch_lines = next_pow2(triton.cdiv(inter, line_elems)) if prefetch else 0
    preload = (
        preload_cols(cfg.get("preload"), block_i, inter, k_pad * block_h, w) if routing_ready else 0
    )
    _down_kernel[(n_tokens, triton.cdiv(hidden, block_h))](
        act,
        w.stored,
        w.scale,
        ids,
        route_w,
        y,
        n_tokens,
        hidden,
        inter,
        top_k,
        w.stored.stride(0),
        w.stored.stride(1),
        w.scale.stride(0),
        w.scale.stride(1),
        y.stride(0),
        K_PAD=k_pad,
        BLOCK_H=block_h,
        BLOCK_I=block_i,
        EVEN_K=k_pad == top_k,
        EVEN_H=hidden % block_h == 0,
        EVEN_I=inter % block_i == 0,
        FORMAT=w.format,
        SCALE_ROWS=w.scale_rows,
        SCALE_COLS=w.scale_cols,
        PER_ITEM=w.per_item,
        PDL=pdl,
        PREFETCH_LINES=prefetch_lines,
        LINE_ELEMS=line_elems,
        PRELOAD=preload,
        EVEN_PRELOAD=0 < preload <= inter,
        ROUTING_READY=routing_ready or not pdl,
        LOOP_STAGES=cfg.get("loop_stages", 1),
        **_launch_opts(cfg, pdl),
    )
    return y


PERSISTENT_COUNTERS = "warp decode persistent"
# Programs of one persistent launch under the CPU interpreter (which runs them one by one):
# enough that the counters' reset by the last one is exercised.
INTERPRETED_PROGRAMS = 3


def persistent_moe(x, w_gate_up: Weight, w_down: Weight, ids, route_w, cfg: dict, pdl=False):
    """The MoE layer in one launch (_persistent_kernel): cfg["persistent"] programs per SM take
    the gate/up items of cfg["gate_up"]'s tiles, then the down items of cfg["down"]'s, whose
    preload (one step's or more) is loaded before each waits for its token. Returns y [T, H].
    `pdl`: a link of a PDL chain (waits for the kernel before, lets the one after start).
    Of the pair's config it takes the tiles, preloads, loop stages and the larger num_warps;
    the pair's own PDL, prefetch and num_stages keys do not apply to one launch."""
    n_tokens, hidden = x.shape
    top_k = ids.shape[1]
    inter = w_down.shape[2]
    gu, dn = kernel_weight(w_gate_up), kernel_weight(w_down)
    # One FORMAT serves both kinds of item.
    assert gu.format == dn.format and gu.per_item == dn.per_item, "mixed weight formats"
    block_i, block_h = gate_up_launch_tiles(cfg["gate_up"], gu, hidden, inter)
    k_pad, d_block_h, d_block_i = down_launch_tiles(cfg["down"], dn, hidden, inter, top_k)
    preload = preload_cols(cfg["down"].get("preload"), d_block_i, inter, k_pad * d_block_h, dn)
    n_i, n_h = triton.cdiv(inter, block_i), triton.cdiv(hidden, d_block_h)
    n_items = n_tokens * (top_k * n_i + n_h)
    if x.is_cuda and not interpreting():
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        programs = min(n_items, int(cfg["persistent"]) * sm_count(index))
    else:
        programs = min(n_items, INTERPRETED_PROGRAMS)
    counters = zeroed_counters(x.device, 2 + n_tokens, PERSISTENT_COUNTERS)
    act = torch.empty(n_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(n_tokens, hidden, dtype=x.dtype, device=x.device)
    warps = max(cfg["gate_up"]["num_warps"], cfg["down"]["num_warps"])
    _persistent_kernel[(programs,)](
        x, gu.stored, gu.scale, ids, route_w, act, dn.stored, dn.scale, y, counters,
        n_tokens, hidden, inter, top_k, n_i, n_h,
        x.stride(0), gu.stored.stride(0), gu.stored.stride(1), gu.scale.stride(0),
        gu.scale.stride(1), dn.stored.stride(0), dn.stored.stride(1), dn.scale.stride(0),
        dn.scale.stride(1), y.stride(0),
        G_BLOCK_I=block_i,
        G_BLOCK_H=block_h,
        G_EVEN_I=inter % block_i == 0,
        G_EVEN_H=hidden % block_h == 0,
        G_SCALE_ROWS=gu.scale_rows,
        G_SCALE_COLS=gu.scale_cols,
        G_LOOP_STAGES=cfg["gate_up"].get("loop_stages", 1),
        K_PAD=k_pad,
        D_BLOCK_H=d_block_h,
        D_BLOCK_I=d_block_i,
        EVEN_K=k_pad == top_k,
        D_EVEN_H=hidden % d_block_h == 0,
        D_EVEN_I=inter % d_block_i == 0,
        D_SCALE_ROWS=dn.scale_rows,
        D_SCALE_COLS=dn.scale_cols,
        PRELOAD=preload,
        EVEN_PRELOAD=0 < preload <= inter,
        D_LOOP_STAGES=cfg["down"].get("loop_stages", 1),
        FORMAT=dn.format,
        PER_ITEM=dn.per_item,
        BLOCK_T=64,
        PDL=pdl,
        **_launch_opts({"num_warps": warps}, pdl),
    )  # fmt: skip
    return y
