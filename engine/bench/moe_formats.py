"""The MoE layer over bf16, FP8 and int4 weights, side by side on the GPU.

    python -m engine.bench.moe_formats --out moe_formats.json
    python -m engine.bench.moe_formats --tune --out moe_formats.json  # also write the tables

Shape: the Qwen3-30B-A3B MoE layer (H=2048, I=768, E=128, k=8); random weights quantized by the
project's own quantizers (FP8 blocks of 128x128, int4 groups of 128), several layers cycled so
L2 cannot help. Per format and batch: the floor (the bytes of the distinct experts touched, as
stored, over the measured read bandwidth), warp decode, the expert-centric path and the
dispatcher, µs per layer under CUDA graphs (best of two medians), and each path's error against
a float64 reference on the dequantized weights. `--tune` first sweeps warp decode's tiles per
format at small batches, the stored config among them, and writes them into
`kernels/configs/warp_decode[_fp8|_int4]_*.json` (other batches' entries kept), and the quantized
formats' crossover entries, which the dispatcher reads (bf16's come from kernels.bench.tune_moe,
which times every batch).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from pathlib import Path

import torch

from engine.loading import fp8, int4
from kernels import dispatch, reference, tuned
from kernels.bench.gpu_timing import graph_time_us, read_bandwidth
from kernels.counters import counters_of
from kernels.fused_moe import fused_moe
from kernels.quant import dequantize, kernel_weight, nbytes
from kernels.warp_decode import (
    PERSISTENT_COUNTERS,
    default_configs,
    down_launch_tiles,
    gate_up_launch_tiles,
    preload_cols,
    warp_decode_moe,
)

SHAPE = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}
FORMATS = ("bf16", "fp8", "int4")
BATCHES = (1, 2, 4, 8, 16, 32, 64)
TUNE_BATCHES = (1, 2, 4, 8)


def quantized(w: torch.Tensor, fmt: str):
    if fmt == "fp8":
        return fp8.quantized_weight(w, 128)
    if fmt == "int4":
        return int4.quantized_weight(w, 128)
    return w.to(torch.bfloat16)


class Layers:
    """n MoE layers of random weights in one format, and per batch their inputs and routing."""

    def __init__(self, n: int, fmt: str, seed: int = 0):
        h, i, e = SHAPE["hidden"], SHAPE["inter"], SHAPE["experts"]
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.n, self.fmt = n, fmt
        self.gate_up, self.down, self.router = [], [], []
        for _ in range(n):
            draw = torch.randn(e, 2 * i, h, generator=gen, device="cuda") * h**-0.5
            self.gate_up.append(quantized(draw, fmt))
            draw = torch.randn(e, h, i, generator=gen, device="cuda") * i**-0.5
            self.down.append(quantized(draw, fmt))
            del draw
            self.router.append(torch.randn(e, h, generator=gen, device="cuda").bfloat16())
        self.expert_bytes = (nbytes(self.gate_up[0]) + nbytes(self.down[0])) / e

    def inputs(self, batch: int, seed: int):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        out = []
        for layer in range(self.n):
            x = torch.randn(batch, SHAPE["hidden"], generator=gen, device="cuda").bfloat16()
            ids, w = reference.route(x, self.router[layer], SHAPE["top_k"], norm_topk_prob=True)
            out.append((x, self.gate_up[layer], self.down[layer], ids.contiguous(), w))
        return out


def time_us(fn, inputs, replays: int) -> float:
    return min(
        graph_time_us(lambda: [fn(*args) for args in inputs], replays) / len(inputs)
        for _ in range(2)
    )


def error(fn, args) -> float:
    x, w_gate_up, w_down, ids, weights = args
    y = fn(*args).double()
    ref = reference.moe_float64(
        x, dequantize(w_gate_up, torch.float64), dequantize(w_down, torch.float64), ids, weights
    )
    return float((y - ref).norm() / ref.norm())


# Warp decode's tiles to sweep: kernel 1's (rows, columns, warps) per program, kernel 2's (rows,
# columns per step, pdl, columns loaded before its PDL wait (True: one step's)).
GATE_UP_TILES = [(1, 2048, 4), (2, 1024, 4), (2, 512, 4), (4, 256, 4), (8, 128, 4), (16, 128, 4)]
DOWN_TILES = [
    (2, 128, True, True),
    (4, 128, True, True),
    (8, 128, True, True),
    (4, 256, True, True),
    (4, 128, False, False),
    (8, 128, True, 512),
    (4, 128, True, 1024),
    (8, 128, True, 1024),
]
# A program's bytes in flight per step scale with the format's bytes per value: a bf16 tile of
# 2,048 values is 4 KB a matrix, an int4 one 1 KB. The narrower formats also try tiles of as
# many bytes a step as bf16's (FP8: twice the values, int4: up to four times); each compiles for
# sm_90 without spilling (register counts of ptxas, BENCHMARKS.md).
WIDER_GATE_UP_TILES = {
    "fp8": [(2, 2048, 4), (4, 1024, 4), (8, 512, 4), (16, 256, 4)],
    "int4": [(4, 1024, 4), (8, 512, 4), (16, 256, 4), (4, 2048, 4), (8, 1024, 4), (16, 512, 4)],
}
WIDER_DOWN_TILES = {
    "fp8": [(8, 256, True, True)],
    "int4": [(8, 256, True, True), (4, 512, True, True), (8, 256, True, 512), (4, 512, True, 1024)],
}
TILE_KEYS = ("BLOCK_H", "BLOCK_I", "preload")  # what `resolved` replaces by the tiles that run
# Second round: the fastest few tiles of each kernel, every pairing.
PAIRED_TILES = 3


def gate_up_tiles(fmt: str) -> list[dict]:
    return [
        {"BLOCK_I": bi, "BLOCK_H": bh, "num_warps": warps}
        for bi, bh, warps in GATE_UP_TILES + WIDER_GATE_UP_TILES.get(fmt, [])
    ]


def down_tiles(fmt: str) -> list[dict]:
    return [
        {"BLOCK_H": dh, "BLOCK_I": di, "num_warps": 4, "pdl": pdl, "preload": preload}
        for dh, di, pdl, preload in DOWN_TILES + WIDER_DOWN_TILES.get(fmt, [])
    ]


def warp_candidates(fmt: str, stored: dict, weights: tuple) -> list[dict]:
    """First round: the stored config, each kernel-1 tile with the stored kernel 2, and each
    kernel-2 tile with the stored kernel 1 (the kernels overlap only in their tails, so each
    one's ranking mostly holds whatever the other runs; `paired` covers the rest). Configs that
    run the same kernels (`resolved`) are timed once."""
    out = [stored]
    out += [{"gate_up": g, "down": stored["down"]} for g in gate_up_tiles(fmt)]
    out += [{"gate_up": stored["gate_up"], "down": d} for d in down_tiles(fmt)]
    return _unique(out, functools.partial(config_key, weights=weights))


def paired(timed: list, already: list, weights: tuple) -> list[dict]:
    """Second round: the PAIRED_TILES fastest kernel-1 tiles of the timed configs (fastest
    first) with the PAIRED_TILES fastest kernel-2 tiles, every pairing not yet timed."""
    fastest = {
        kernel: _unique(
            [c[kernel] for _, c in timed],
            functools.partial(resolved, kernel, weights=weights),
        )[:PAIRED_TILES]
        for kernel in ("gate_up", "down")
    }
    pairs = [{"gate_up": g, "down": d} for g in fastest["gate_up"] for d in fastest["down"]]
    key = functools.partial(config_key, weights=weights)
    timed_keys = {key(c) for c in already}
    return [c for c in _unique(pairs, key) if key(c) not in timed_keys]


def resolved(kernel: str, cfg: dict, weights: tuple) -> tuple:
    """What a kernel's config runs: its tiles as the launcher fits them to SHAPE and the
    weights (weights: the gate/up and down KernelWeights), kernel 2's preloaded columns, and
    its other keys. Two configs may name different tiles and run the same kernel."""
    h, i, k = SHAPE["hidden"], SHAPE["inter"], SHAPE["top_k"]
    gate_up, down = weights
    if kernel == "gate_up":
        tiles = gate_up_launch_tiles(cfg, gate_up, h, i)
    else:
        k_pad, block_h, block_i = down_launch_tiles(cfg, down, h, i, k)
        preload = preload_cols(cfg.get("preload"), block_i, i, k_pad * block_h, down)
        tiles = (k_pad, block_h, block_i, preload)
    rest = sorted((name, repr(v)) for name, v in cfg.items() if name not in TILE_KEYS)
    return tiles, tuple(rest)


def config_key(cfg: dict, weights: tuple) -> tuple:
    return (
        resolved("gate_up", cfg["gate_up"], weights),
        resolved("down", cfg["down"], weights),
        cfg.get("persistent", 0),
    )


def tile_name(cfg: dict, kernel: str, dims: tuple[str, str]) -> str:
    """A kernel's rows x columns, for the log."""
    return "x".join(str(cfg[kernel][d]) for d in dims)


def _unique(items: list, key) -> list:
    """items in order, the first of each key."""
    firsts = {}
    for item in items:
        firsts.setdefault(key(item), item)
    return list(firsts.values())


# A candidate whose output is further than this from float64 is wrong, not slow: bf16 rounding
# of the output gives about 2e-3 (BENCHMARKS.md, "MoE layer").
MAX_CANDIDATE_ERROR = 1e-2
# Two summation orders of the same bf16 products differ by about one output rounding.
BF16_ORDER_DIFFERENCE = 4e-3


# Loop pipelining depths (config "loop_stages") swept for the fastest first-round candidates.
LOOP_STAGES = (1, 2, 3, 4)
STAGED_CANDIDATES = 3


# Programs per SM swept for the persistent form (both kernels' items in one launch).
PERSISTENT_PROGRAMS = (2, 4, 8)


def as_persistent(cfg: dict):
    """cfg's tiles in one persistent launch, at each of PERSISTENT_PROGRAMS per SM."""
    for programs in PERSISTENT_PROGRAMS:
        yield dict(cfg, persistent=programs)


def with_loop_stages(cfg: dict):
    """cfg's tiles with each kernel's loop at every pair of LOOP_STAGES depths but cfg's own
    (a missing loop_stages is depth 1)."""
    own = (cfg["gate_up"].get("loop_stages", 1), cfg["down"].get("loop_stages", 1))
    for g, d in itertools.product(LOOP_STAGES, LOOP_STAGES):
        if (g, d) != own:
            yield {
                "gate_up": dict(cfg["gate_up"], loop_stages=g),
                "down": dict(cfg["down"], loop_stages=d),
            }


def one_launch_is_the_pair(cfg: dict, inputs: list) -> bool:
    """After the graph replays of its timing, the persistent launch gives the same bits eagerly
    and in a fresh graph replayed three times, within bf16 rounding of the pair with its tiles
    (bit-equal where both compile to one layout), and leaves its counters at zero: on the GPU
    its programs run at once, which the interpreter tests cannot show."""
    pair = {k: v for k, v in cfg.items() if k != "persistent"}
    expected = [warp_decode_moe(*args, config=pair) for args in inputs]
    eager = [warp_decode_moe(*args, config=cfg) for args in inputs]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [warp_decode_moe(*args, config=cfg) for args in inputs]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    counters = counters_of(inputs[0][0].device, PERSISTENT_COUNTERS)
    near = all(
        float((a.float() - b.float()).norm() / b.float().norm()) <= BF16_ORDER_DIFFERENCE
        for a, b in zip(eager, expected)
    )
    return near and all(map(torch.equal, eager, captured)) and not counters.any()


def time_candidates(layers: Layers, batch: int, inputs: list, candidates, replays: int, log):
    """(µs per layer, cfg) of each candidate that compiles and is right, the fastest first."""
    timed = []
    for cfg in candidates:
        run = functools.partial(warp_decode_moe, config=cfg)
        try:
            err = error(run, inputs[0])
            us = graph_time_us(lambda f=run, xs=inputs: [f(*a) for a in xs], replays)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is skipped
            log(f"  {layers.fmt} B={batch} {cfg}: {type(exc).__name__}: {str(exc)[-1500:]}")
            continue
        if not err <= MAX_CANDIDATE_ERROR:
            log(f"  {layers.fmt} B={batch} {cfg}: error {err:.2e} against float64, left out")
            continue
        if "persistent" in cfg and not one_launch_is_the_pair(cfg, inputs):
            log(f"  {layers.fmt} B={batch} {cfg}: one launch differs from the pair, left out")
            continue
        timed.append((us / len(inputs), cfg))
    return sorted(timed, key=lambda t: t[0])


def best_by(timed: list, key) -> dict:
    best = {}
    for t, c in timed:
        best[key(c)] = min(best.get(key(c), t), t)
    return {k: round(v, 1) for k, v in best.items()}


def crossover_entry(entry: dict | None, device: str, e: int, k: int, fmt: str, rows) -> dict:
    """The dispatcher's entry for one format after timing `rows`: the faster path per batch.
    Batches this run did not time keep the same device's earlier measurements."""
    same_device = entry is not None and entry.get("device") == device
    winners = dict(entry.get("winners", {})) if same_device else {}
    us = dict(entry.get("us_per_layer", {})) if same_device else {}
    for r in rows:
        warp, ec = r["warp_decode_us"], r["expert_centric_us"]
        winners[str(r["batch"])] = "warp_decode" if warp <= ec else "expert_centric"
        us[str(r["batch"])] = {"warp_decode": warp, "expert_centric": ec}
    return dict(device=device, experts=e, top_k=k, weights=fmt, winners=winners, us_per_layer=us)


def tune_warp(layers: Layers, inputs: dict, replays: int, log) -> dict:
    """Per batch: the stored config and each kernel's tiles (warp_candidates), then the fastest
    tiles paired, then the fastest few with their loops pipelined to each depth, then the
    fastest few of all as one persistent launch."""
    best = {}
    h, i, e, k = SHAPE["hidden"], SHAPE["inter"], SHAPE["experts"], SHAPE["top_k"]
    weights = (kernel_weight(layers.gate_up[0]), kernel_weight(layers.down[0]))
    for batch in TUNE_BATCHES:
        stored = default_configs(batch, h, i, e, k, layers.fmt)
        candidates = warp_candidates(layers.fmt, stored, weights)
        timed = time_candidates(layers, batch, inputs[batch], candidates, replays, log)
        if not timed:
            log(f"  {layers.fmt} B={batch}: no config ran; the defaults stay")
            continue
        more = paired(timed, candidates, weights)
        timed = sorted(
            timed + time_candidates(layers, batch, inputs[batch], more, replays, log),
            key=lambda t: t[0],
        )
        for widen in (with_loop_stages, as_persistent):
            pairs = [c for _, c in timed if "persistent" not in c][:STAGED_CANDIDATES]
            more = [w for c in pairs for w in widen(c)]
            timed = sorted(
                timed + time_candidates(layers, batch, inputs[batch], more, replays, log),
                key=lambda t: t[0],
            )
        us, cfg = timed[0]
        best[batch] = cfg
        log(f"  tuned {layers.fmt} B={batch}: {us:.1f} µs {cfg}")
        for kernel, dims in (("gate_up", ("BLOCK_I", "BLOCK_H")), ("down", ("BLOCK_H", "BLOCK_I"))):
            tiles = best_by(timed, functools.partial(tile_name, kernel=kernel, dims=dims))
            log(f"  best per {kernel} tile (rows x columns), {layers.fmt} B={batch}: {tiles}")
        preloads = best_by(timed, lambda c: str(c["down"].get("preload")))
        log(f"  best per down preload, {layers.fmt} B={batch}: {preloads}")
        stages = best_by(
            timed,
            lambda c: f"{c['gate_up'].get('loop_stages', 1)},{c['down'].get('loop_stages', 1)}",
        )
        log(f"  best per loop stages (gate/up, down), {layers.fmt} B={batch}: {stages}")
        persistent = best_by(timed, lambda c: str(c.get("persistent", "pair")))
        log(f"  best per persistent programs per SM, {layers.fmt} B={batch}: {persistent}")
    return best


def save_tuned(fmt: str, best: dict, device: str) -> None:
    """The tuned batches' configs into the format's table; other batches' entries stay."""
    if not best:
        return
    h, i, e, k = SHAPE["hidden"], SHAPE["inter"], SHAPE["experts"], SHAPE["top_k"]
    name = tuned.shape_name("warp_decode" if fmt == "bf16" else f"warp_decode_{fmt}", h, i, e, k)
    table = dict(tuned.load(name) or {}, device=device)
    for kernel in ("gate_up", "down"):
        table[kernel] = dict(table.get(kernel, {}))
        table[kernel].update({str(b): c[kernel] for b, c in best.items()})
    # Programs per SM where the one-launch form won, 0 where the pair did.
    table["persistent"] = dict(table.get("persistent", {}))
    table["persistent"].update({str(b): c.get("persistent", 0) for b, c in best.items()})
    tuned.save(name, table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--tune", action="store_true", help="tune quantized warp decode first")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = read_bandwidth()["read_bytes_per_s"]
    device = torch.cuda.get_device_name()
    log(f"{device}; read bandwidth {bandwidth / 1e12:.2f} TB/s; shape {SHAPE}")
    result = {"device": device, "shape": SHAPE, "bandwidth": bandwidth, "rows": []}
    e, k = SHAPE["experts"], SHAPE["top_k"]
    for fmt in args.formats.split(","):
        layers = Layers(args.layers, fmt)
        # The tune covers TUNE_BATCHES whatever --batches times.
        wanted = set(batches) | (set(TUNE_BATCHES) if args.tune else set())
        inputs = {b: layers.inputs(b, seed=100 + b) for b in sorted(wanted)}
        if args.tune:
            save_tuned(fmt, tune_warp(layers, inputs, args.replays, log), device)
        rows = []
        for batch in batches:
            distinct = sum(int(torch.unique(a[3]).numel()) for a in inputs[batch]) / layers.n
            row = {
                "format": fmt,
                "batch": batch,
                "floor_us": distinct * layers.expert_bytes / bandwidth * 1e6,
                "warp_decode_us": time_us(warp_decode_moe, inputs[batch], args.replays),
                "expert_centric_us": time_us(fused_moe, inputs[batch], args.replays),
                "warp_decode_err": error(warp_decode_moe, inputs[batch][0]),
                "expert_centric_err": error(fused_moe, inputs[batch][0]),
            }
            rows.append(row)
        if args.tune and fmt != "bf16":
            table = dict(tuned.load("crossover.json") or {})
            name = f"E{e}_k{k}_{fmt}"
            table[name] = crossover_entry(table.get(name), device, e, k, fmt, rows)
            tuned.save("crossover.json", table)
        for row in rows:
            row["dispatch_path"] = dispatch.choose_path(row["batch"], k, e, fmt)
            row["dispatch_us"] = time_us(dispatch.moe, inputs[row["batch"]], args.replays)
            log(
                f"{fmt:>4} B={row['batch']:<3} floor {row['floor_us']:6.1f}  warp "
                f"{row['warp_decode_us']:6.1f}  expert-centric {row['expert_centric_us']:6.1f}  "
                f"dispatch {row['dispatch_us']:6.1f} ({row['dispatch_path']})  err warp "
                f"{row['warp_decode_err']:.2e} ec {row['expert_centric_err']:.2e}"
            )
        result["rows"] += rows
        del layers, inputs
        torch.cuda.empty_cache()
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
