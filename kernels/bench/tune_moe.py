"""Block-size tuning for the MoE paths, run by `python -m kernels.bench.moe --tune` on the GPU.

Each stage is tuned on its own (warp decode: kernel 1, kernel 2; expert-centric: align, gate_up,
down for each BLOCK_M), every candidate timed as a CUDA graph over all the benchmark's weight
sets, and checked once against the default config's output before it may win. The overlap of
warp decode's two kernels (programmatic dependent launch, L2 prefetch) only shows in the whole
layer, so those choices and the deduplicated variant are timed as whole layers. Candidates are
compiled first in parallel worker processes that fill Triton's on-disk cache, since compiling
~100 kernels one after another would cost minutes of device time.
"""

from __future__ import annotations

import concurrent.futures as futures
import itertools
import math
import multiprocessing
import os
from functools import partial

import torch

from kernels import fused_moe as ec
from kernels import warp_decode as wd
from kernels.bench.gpu_timing import graph_time_us
from kernels.moe_align import align_by_expert


def _warp_gate_up_candidates():
    out = []
    for block_i, block_h, warps in itertools.product(
        (1, 2, 4, 8, 16, 32), (128, 256, 512, 1024, 2048), (4, 8)
    ):
        if 2048 <= block_i * block_h <= 8192:
            out.append({"BLOCK_I": block_i, "BLOCK_H": block_h, "num_warps": warps})
    return out


def _warp_down_candidates(top_k: int):
    k_pad = 1 << max(0, top_k - 1).bit_length()
    out = []
    for block_h, block_i, warps in itertools.product((1, 2, 4, 8, 16), (64, 128, 256, 512), (4, 8)):
        if 2048 <= k_pad * block_h * block_i <= wd.DOWN_TILE_BUDGET:
            out.append({"BLOCK_H": block_h, "BLOCK_I": block_i, "num_warps": warps})
    return out


FUSED_BLOCK_M = (16, 32)
_GEMM_TILES = ((32, 128), (32, 256), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128))


def _gemm_candidates():
    return [
        {"BLOCK_N": n, "BLOCK_K": k, "num_warps": 4, "num_stages": s}
        for (n, k), s in itertools.product(_GEMM_TILES, (2, 3, 4))
    ]


# ---------------------------------------------------------------- parallel precompile

_worker_layer = {}


def _compile_job(job):
    """Run one candidate pair once at the benchmark's shape, so Triton caches its binary."""
    try:
        return _compile(*job)
    except Exception:  # e.g. a tile past shared memory: the tuner skips it later
        return False


def _compile(kind, shape, cfg_a, cfg_b, block_m, tokens=2):
    hidden, inter, experts, top_k = shape
    if shape not in _worker_layer:
        _worker_layer.clear()
        _worker_layer[shape] = (
            torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16),
            torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16),
        )
    w_gate_up, w_down = _worker_layer[shape]
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, device="cuda")
    if kind == "warp":
        wd.warp_decode_moe(x, w_gate_up, w_down, ids, weights, {"gate_up": cfg_a, "down": cfg_b})
    elif kind == "dedup":
        from kernels.warp_decode_dedup import warp_decode_dedup_moe

        warp_decode_dedup_moe(x, w_gate_up, w_down, ids, weights, {"gate_up": cfg_a, "down": cfg_b})
    else:
        ec.fused_moe(
            x,
            w_gate_up,
            w_down,
            ids,
            weights,
            {"BLOCK_M": block_m, "gate_up": cfg_a, "down": cfg_b},
        )
    torch.cuda.synchronize()
    return True


def _pairs(a, b):
    n = max(len(a), len(b))
    return [(a[i % len(a)], b[i % len(b)]) for i in range(n)]


def precompile(hidden, inter, experts, top_k, log=print, jobs=None):
    """Fill Triton's cache in worker processes: all candidates, or the given (kind, cfg_a, cfg_b,
    block_m, tokens) jobs."""
    shape = (hidden, inter, experts, top_k)
    if jobs is not None:
        jobs = [(kind, shape, a, b, m, t) for kind, a, b, m, t in jobs]
    else:
        jobs = [
            ("warp", shape, a, b, 0)
            for a, b in _pairs(_warp_gate_up_candidates(), _warp_down_candidates(top_k))
        ]
        for block_m in FUSED_BLOCK_M:
            jobs += [
                ("fused", shape, a, b, block_m)
                for a, b in _pairs(_gemm_candidates(), _gemm_candidates())
            ]
    workers = max(1, min(16, (os.cpu_count() or 2) - 1))
    log(f"precompiling {len(jobs)} candidate pairs in {workers} processes")
    try:
        ctx = multiprocessing.get_context("spawn")
        with futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            failed = sum(1 for ok in pool.map(_compile_job, jobs) if not ok)
        log(f"precompile done ({failed} failed)")
    except Exception as exc:  # compiling serially below still works, only slower
        log(f"precompile skipped: {exc!r}")


# ---------------------------------------------------------------- stage tuning


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _best(times, candidates, fallback):
    """(config, µs) of the fastest candidate; the fallback (untimed) if none ran."""
    if not times:
        return fallback, float("nan")
    idx = min(times, key=times.get)
    return candidates[idx], times[idx]


def _every_layer(run, cfg, n_layers):
    """One timed unit: `run(cfg, layer)` for every layer in turn (weights cycled past L2)."""
    return [run(cfg, l) for l in range(n_layers)]


def _layer_runner(fn, layer_args):
    """run(cfg, layer) = fn(*layer_args[layer], cfg), for `_time_candidates`: the arguments are
    bound here, so a runner made in a loop never sees a later iteration's inputs."""
    return lambda cfg, l: fn(*layer_args[l], cfg)


def _time_candidates(name, candidates, run, reference_out, replays, n_layers, log):
    """{index: µs per layer} for candidates whose output matches the reference."""
    times = {}
    for idx, cfg in enumerate(candidates):
        try:
            out = run(cfg, 0)
            err = _rel(out, reference_out)
            if not torch.isfinite(out).all() or err > 1e-2:
                log(f"  {name} {cfg}: wrong output (rel err {err:.2e}), skipped")
                continue
            times[idx] = (
                graph_time_us(partial(_every_layer, run, cfg, n_layers), replays) / n_layers
            )
        except Exception as exc:
            log(f"  {name} {cfg}: failed ({type(exc).__name__}: {exc})")
    return times


def tune_warp_decode(layers, batches, inputs, replays=40, log=print):
    """{"gate_up": {B: cfg}, "down": {B: cfg}, "us": {B: {"gate_up": t, "down": t}}}."""
    gate_up_cands = _warp_gate_up_candidates()
    down_cands = _warp_down_candidates(layers.top_k)
    result = {"gate_up": {}, "down": {}, "us": {}}
    n = layers.n_layers
    for batch in batches:
        xs, ids, weights = inputs[batch]
        base_act = [
            wd.gate_up_silu(xs[l], layers.w_gate_up[l], ids[l], wd.DEFAULT_GATE_UP)
            for l in range(n)
        ]
        base_y = wd.down(base_act[0], layers.w_down[0], ids[0], weights[0], wd.DEFAULT_DOWN)

        run_gate_up = _layer_runner(
            wd.gate_up_silu, [(xs[l], layers.w_gate_up[l], ids[l]) for l in range(n)]
        )
        run_down = _layer_runner(
            wd.down, [(base_act[l], layers.w_down[l], ids[l], weights[l]) for l in range(n)]
        )

        t1 = _time_candidates(
            "warp gate_up", gate_up_cands, run_gate_up, base_act[0], replays, n, log
        )
        t2 = _time_candidates("warp down", down_cands, run_down, base_y, replays, n, log)
        c1, us1 = _best(t1, gate_up_cands, wd.DEFAULT_GATE_UP)
        c2, us2 = _best(t2, down_cands, wd.DEFAULT_DOWN)
        result["gate_up"][str(batch)] = c1
        result["down"][str(batch)] = c2
        result["us"][str(batch)] = {"gate_up": us1, "down": us2}
        log(f"B={batch:3d} warp decode: gate_up {us1:7.2f} us {c1}  down {us2:7.2f} us {c2}")
    return result


def _align_every_layer(ids, experts, block_m):
    return [align_by_expert(layer_ids, experts, block_m) for layer_ids in ids]


def tune_fused(layers, batches, inputs, replays=40, log=print):
    """{"configs": {B: cfg}, "us": {B: {"align", "gate_up", "down"}}} choosing BLOCK_M per B."""
    cands = _gemm_candidates()
    n = layers.n_layers
    result = {"configs": {}, "us": {}}
    for batch in batches:
        xs, ids, weights = inputs[batch]
        best = None
        for block_m in FUSED_BLOCK_M:
            groups = [align_by_expert(ids[l], layers.experts, block_m) for l in range(n)]
            t_align = (
                graph_time_us(partial(_align_every_layer, ids, layers.experts, block_m), replays)
                / n
            )
            base_act = [
                ec.gate_up_stage(
                    xs[l],
                    layers.w_gate_up[l],
                    groups[l],
                    layers.top_k,
                    block_m,
                    ec.DEFAULT_CONFIG["gate_up"],
                )
                for l in range(n)
            ]
            base_out = ec.down_stage(
                base_act[0],
                layers.w_down[0],
                weights[0],
                groups[0],
                block_m,
                ec.DEFAULT_CONFIG["down"],
            )

            run_gate_up = _layer_runner(
                ec.gate_up_stage,
                [(xs[l], layers.w_gate_up[l], groups[l], layers.top_k, block_m) for l in range(n)],
            )
            run_down = _layer_runner(
                ec.down_stage,
                [(base_act[l], layers.w_down[l], weights[l], groups[l], block_m) for l in range(n)],
            )

            t1 = _time_candidates(
                f"ec gate_up M{block_m}", cands, run_gate_up, base_act[0], replays, n, log
            )
            t2 = _time_candidates(f"ec down M{block_m}", cands, run_down, base_out, replays, n, log)
            c1, us1 = _best(t1, cands, ec.DEFAULT_CONFIG["gate_up"])
            c2, us2 = _best(t2, cands, ec.DEFAULT_CONFIG["down"])
            total = t_align + us1 + us2
            if best is None or math.isnan(best[0]) or total < best[0]:  # NaN: nothing ran
                best = (
                    total,
                    {"BLOCK_M": block_m, "gate_up": c1, "down": c2},
                    {"align": t_align, "gate_up": us1, "down": us2},
                )
        result["configs"][str(batch)] = best[1]
        result["us"][str(batch)] = best[2]
        log(f"B={batch:3d} expert-centric: {best[2]} {best[1]}")
    return result


def _batched_candidates():
    gate_up = [
        {"BLOCK_I": i, "BLOCK_H": h, "num_warps": 4, "num_stages": st}
        for (i, h), st in itertools.product(
            ((16, 128), (32, 128), (64, 128), (16, 256), (32, 256)), (2, 3)
        )
    ]
    down = [
        {"BLOCK_H": h, "BLOCK_I": i, "num_warps": 4, "num_stages": st}
        for (h, i), st in itertools.product(
            ((16, 128), (32, 128), (64, 128), (16, 256), (32, 256)), (2, 3)
        )
    ]
    return gate_up, down


def tune_batched(layers, batches, inputs, replays=40, log=print):
    """{"configs": {B: cfg}, "us": {B: t}}: gate_up tiles first (down at its default), then down."""
    from kernels import warp_decode_batched as wb

    gate_up_cands, down_cands = _batched_candidates()
    n = layers.n_layers
    result = {"configs": {}, "us": {}}
    for batch in batches:
        if batch > wb.MAX_TOKENS or batch < 8:  # below 8 tokens plain warp decode wins anyway
            continue
        xs, ids, weights = inputs[batch]
        args = [
            (xs[l], layers.w_gate_up[l], layers.w_down[l], ids[l], weights[l]) for l in range(n)
        ]
        reference_out = wd.warp_decode_moe(*args[0])
        cfg = dict(wb.DEFAULT_CONFIG)
        best_us = float("nan")
        for stage, cands in (("gate_up", gate_up_cands), ("down", down_cands)):
            trial = [dict(cfg, **{stage: c}) for c in cands]
            times = _time_candidates(
                f"batched {stage}",
                trial,
                _layer_runner(wb.warp_decode_batched_moe, args),
                reference_out,
                replays,
                n,
                log,
            )
            cfg, best_us = _best(times, trial, cfg)
        result["configs"][str(batch)] = cfg
        result["us"][str(batch)] = best_us
        log(f"B={batch:3d} batched warp decode: {best_us:7.2f} us {cfg}")
    return result


# ---------------------------------------------------------------- overlap and deduplication

DEDUP_GATE_UP = [
    {"GROUP": g, "BLOCK_I": i, "BLOCK_H": h, "num_warps": w}
    for g, i, h, w in (
        (1, 2, 1024, 4),
        (2, 2, 512, 4),
        (2, 2, 1024, 8),
        (4, 2, 512, 8),
        (2, 4, 512, 8),
        (4, 1, 1024, 4),
    )
]


def _down_variants(down: dict) -> list:
    """The tuned down config without overlap, with it, with it and the L2 prefetch, and the
    prefetch at half and twice the hidden block (fewer or more programs to hold the rows)."""
    base = {k: v for k, v in down.items() if k not in ("pdl", "prefetch", "preload")}
    out = [
        dict(base, pdl=False, prefetch=False),
        dict(base, pdl=True, prefetch=False),
        dict(base, pdl=True, prefetch=True),
        dict(base, pdl=True, preload=True),
    ]
    if base["BLOCK_H"] <= 4:  # a longer first chunk; past this the tile spills
        out.append(dict(base, BLOCK_I=256, pdl=True, preload=True))
    for block_h in (base["BLOCK_H"] // 2, base["BLOCK_H"] * 2):
        if 1 <= block_h <= 8:
            out.append(dict(base, BLOCK_H=block_h, pdl=True, preload=True))
    return out


def _layer_variants(base: dict, batch: int) -> list:
    """Whole-layer warp decode candidates: the down variants, and while the routed down
    matrices fit in L2 (B <= 2), kernel 1 prefetching them, with and without the overlap."""
    gate_up = {k: v for k, v in base["gate_up"].items() if k != "prefetch_down"}
    out = [{"gate_up": gate_up, "down": d} for d in _down_variants(base["down"])]
    if batch <= 2:
        out += [
            {"gate_up": dict(gate_up, prefetch_down=True), "down": d}
            for d in _down_variants(base["down"])[:2]
        ]
    if batch == 1:  # kernel 1 with fewer, longer programs, under the overlap
        for block_i, block_h in ((2, 2048), (4, 1024), (1, 2048)):
            g = dict(gate_up, BLOCK_I=block_i, BLOCK_H=block_h)
            out += [{"gate_up": g, "down": d} for d in _down_variants(base["down"])[1:4:2]]
    return out


def overlap_jobs(batches, warp_cfgs):
    """Precompile jobs for `tune_overlap`: (kind, gate_up cfg, down cfg, block_m, tokens)."""
    jobs = []
    for batch in batches:
        cfg = warp_cfgs(batch)
        jobs += [("warp", c["gate_up"], c["down"], 0, batch) for c in _layer_variants(cfg, batch)]
        if batch >= 2:
            jobs += [
                ("dedup", g, dict(cfg["down"], pdl=True, prefetch=True), 0, batch)
                for g in DEDUP_GATE_UP
            ]
    return jobs


def tune_overlap(layers, batches, inputs, warp_cfgs, replays=60, log=print):
    """Per batch: warp decode's best down config with/without overlap (whole layer), and the
    deduplicated variant's best kernel 1 (alone, then whole layer with the best down config).

    Returns {"warp_decode": {"gate_up": {B: cfg}, "down": {B: cfg}},
    "warp_decode_dedup": {"gate_up": {B: cfg}, "down": {B: cfg}}, "us": {B: {...}}}.
    """
    from kernels import warp_decode_dedup as dd

    n = layers.n_layers
    out = {
        "warp_decode": {"gate_up": {}, "down": {}},
        "warp_decode_dedup": {"gate_up": {}, "down": {}},
        "us": {},
    }
    for batch in batches:
        xs, ids, weights = inputs[batch]
        args = [
            (xs[l], layers.w_gate_up[l], layers.w_down[l], ids[l], weights[l]) for l in range(n)
        ]
        gate_up_args = [(xs[l], layers.w_gate_up[l], ids[l]) for l in range(n)]
        reference_out = wd.warp_decode_moe(*args[0], config=warp_cfgs(batch))
        base = warp_cfgs(batch)
        trial = _layer_variants(base, batch)
        times = _time_candidates(
            "warp layer",
            trial,
            _layer_runner(wd.warp_decode_moe, args),
            reference_out,
            replays,
            n,
            log,
        )
        best, best_us = _best(times, trial, base)
        out["warp_decode"]["gate_up"][str(batch)] = best["gate_up"]
        out["warp_decode"]["down"][str(batch)] = best["down"]
        us = {
            "warp_variants": [(trial[i], t) for i, t in times.items()],
            "warp": best_us,
            "warp_gate_up": graph_time_us(
                partial(
                    _every_layer, _layer_runner(wd.gate_up_silu, gate_up_args), base["gate_up"], n
                ),
                replays,
            )
            / n,
        }
        log(
            f"B={batch:3d} warp decode layer: {best_us:7.2f} us {best}  "
            f"(variants: {', '.join(f'{t:.1f}' for t in times.values())})"
        )

        if batch >= 2:
            base_act = wd.gate_up_silu(xs[0], layers.w_gate_up[0], ids[0], base["gate_up"])
            t1 = _time_candidates(
                "dedup gate_up",
                DEDUP_GATE_UP,
                _layer_runner(dd.gate_up_dedup, gate_up_args),
                base_act,
                replays,
                n,
                log,
            )
            g_best, g_us = _best(t1, DEDUP_GATE_UP, dd.DEFAULT_GATE_UP)
            layer = [
                {"gate_up": g_best, "down": d}
                for d in (best["down"], dict(best["down"], pdl=False))
            ]
            t2 = _time_candidates(
                "dedup layer",
                layer,
                _layer_runner(dd.warp_decode_dedup_moe, args),
                reference_out,
                replays,
                n,
                log,
            )
            d_best, d_us = _best(t2, layer, layer[0])
            out["warp_decode_dedup"]["gate_up"][str(batch)] = d_best["gate_up"]
            out["warp_decode_dedup"]["down"][str(batch)] = d_best["down"]
            us.update(
                dedup_gate_up=g_us,
                dedup_gate_up_variants={str(DEDUP_GATE_UP[i]): t for i, t in t1.items()},
                dedup=d_us,
            )
            log(
                f"B={batch:3d} dedup: kernel 1 {g_us:7.2f} us {g_best} "
                f"(plain {us['warp_gate_up']:.2f}); layer {d_us:7.2f} us"
            )
        out["us"][str(batch)] = us
    return out
