"""Block-size tuning for both MoE paths, run by `python -m kernels.bench_moe --tune` on the GPU.

Each stage is tuned on its own (warp decode: kernel 1, kernel 2; expert-centric: align, gate_up,
down for each BLOCK_M), every candidate timed as a CUDA graph over all the benchmark's weight
sets, and checked once against the default config's output before it may win. Candidates are
compiled first in parallel worker processes that fill Triton's on-disk cache, since compiling
~100 kernels one after another would cost minutes of device time.
"""

from __future__ import annotations

import concurrent.futures as futures
import itertools
import math
import multiprocessing
import os

import torch

from kernels import fused_moe as ec
from kernels import warp_decode as wd
from kernels.gpu_timing import graph_time_us
from kernels.moe_align import align_by_expert


def _warp_gate_up_candidates():
    out = []
    for block_i, block_h, warps in itertools.product((1, 2, 4, 8, 16, 32), (128, 256, 512, 1024, 2048), (4, 8)):
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


def _compile(kind, shape, cfg_a, cfg_b, block_m):
    hidden, inter, experts, top_k = shape
    if shape not in _worker_layer:
        _worker_layer.clear()
        _worker_layer[shape] = (
            torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16),
            torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16),
        )
    w_gate_up, w_down = _worker_layer[shape]
    x = torch.randn(2, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(2)])
    weights = torch.rand(2, top_k, device="cuda")
    if kind == "warp":
        wd.warp_decode_moe(x, w_gate_up, w_down, ids, weights, {"gate_up": cfg_a, "down": cfg_b})
    else:
        ec.fused_moe(x, w_gate_up, w_down, ids, weights,
                     {"BLOCK_M": block_m, "gate_up": cfg_a, "down": cfg_b})
    torch.cuda.synchronize()
    return True


def _pairs(a, b):
    n = max(len(a), len(b))
    return [(a[i % len(a)], b[i % len(b)]) for i in range(n)]


def precompile(hidden, inter, experts, top_k, log=print):
    shape = (hidden, inter, experts, top_k)
    jobs = [("warp", shape, a, b, 0)
            for a, b in _pairs(_warp_gate_up_candidates(), _warp_down_candidates(top_k))]
    for block_m in FUSED_BLOCK_M:
        jobs += [("fused", shape, a, b, block_m) for a, b in _pairs(_gemm_candidates(), _gemm_candidates())]
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
            times[idx] = graph_time_us(lambda: [run(cfg, l) for l in range(n_layers)], replays) / n_layers
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
        base_act = [wd.gate_up_silu(xs[l], layers.w_gate_up[l], ids[l], wd.DEFAULT_GATE_UP) for l in range(n)]
        base_y = wd.down(base_act[0], layers.w_down[0], ids[0], weights[0], wd.DEFAULT_DOWN)

        def run_gate_up(cfg, l):
            return wd.gate_up_silu(xs[l], layers.w_gate_up[l], ids[l], cfg)

        def run_down(cfg, l):
            return wd.down(base_act[l], layers.w_down[l], ids[l], weights[l], cfg)

        t1 = _time_candidates("warp gate_up", gate_up_cands, run_gate_up, base_act[0], replays, n, log)
        t2 = _time_candidates("warp down", down_cands, run_down, base_y, replays, n, log)
        c1, us1 = _best(t1, gate_up_cands, wd.DEFAULT_GATE_UP)
        c2, us2 = _best(t2, down_cands, wd.DEFAULT_DOWN)
        result["gate_up"][str(batch)] = c1
        result["down"][str(batch)] = c2
        result["us"][str(batch)] = {"gate_up": us1, "down": us2}
        log(f"B={batch:3d} warp decode: gate_up {us1:7.2f} us {c1}  down {us2:7.2f} us {c2}")
    return result


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
            t_align = graph_time_us(
                lambda: [align_by_expert(ids[l], layers.experts, block_m) for l in range(n)], replays) / n
            base_act = [ec.gate_up_stage(xs[l], layers.w_gate_up[l], groups[l], layers.top_k, block_m,
                                         ec.DEFAULT_CONFIG["gate_up"]) for l in range(n)]
            base_out = ec.down_stage(base_act[0], layers.w_down[0], weights[0], groups[0], block_m,
                                     ec.DEFAULT_CONFIG["down"])

            def run_gate_up(cfg, l):
                return ec.gate_up_stage(xs[l], layers.w_gate_up[l], groups[l], layers.top_k, block_m, cfg)

            def run_down(cfg, l):
                return ec.down_stage(base_act[l], layers.w_down[l], weights[l], groups[l], block_m, cfg)

            t1 = _time_candidates(f"ec gate_up M{block_m}", cands, run_gate_up, base_act[0], replays, n, log)
            t2 = _time_candidates(f"ec down M{block_m}", cands, run_down, base_out, replays, n, log)
            c1, us1 = _best(t1, cands, ec.DEFAULT_CONFIG["gate_up"])
            c2, us2 = _best(t2, cands, ec.DEFAULT_CONFIG["down"])
            total = t_align + us1 + us2
            if best is None or math.isnan(best[0]) or total < best[0]:  # NaN: nothing ran
                best = (total, {"BLOCK_M": block_m, "gate_up": c1, "down": c2},
                        {"align": t_align, "gate_up": us1, "down": us2})
        result["configs"][str(batch)] = best[1]
        result["us"][str(batch)] = best[2]
        log(f"B={batch:3d} expert-centric: {best[2]} {best[1]}")
    return result


def _batched_candidates():
    gate_up = [{"BLOCK_I": i, "BLOCK_H": h, "num_warps": 4, "num_stages": st}
               for (i, h), st in itertools.product(((16, 128), (32, 128), (64, 128), (16, 256), (32, 256)), (2, 3))]
    down = [{"BLOCK_H": h, "BLOCK_I": i, "num_warps": 4, "num_stages": st}
            for (h, i), st in itertools.product(((16, 128), (32, 128), (64, 128), (16, 256), (32, 256)), (2, 3))]
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
        args = [(xs[l], layers.w_gate_up[l], layers.w_down[l], ids[l], weights[l]) for l in range(n)]
        reference_out = wd.warp_decode_moe(*args[0])
        cfg = dict(wb.DEFAULT_CONFIG)
        best_us = float("nan")
        for stage, cands in (("gate_up", gate_up_cands), ("down", down_cands)):
            trial = [dict(cfg, **{stage: c}) for c in cands]
            times = _time_candidates(f"batched {stage}", trial,
                                     lambda c, l: wb.warp_decode_batched_moe(*args[l], config=c),
                                     reference_out, replays, n, log)
            cfg, best_us = _best(times, trial, cfg)
        result["configs"][str(batch)] = cfg
        result["us"][str(batch)] = best_us
        log(f"B={batch:3d} batched warp decode: {best_us:7.2f} us {cfg}")
    return result
