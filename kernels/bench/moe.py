"""MoE layer benchmark on the GPU: floor, expert-centric path, warp decode, dispatcher.

    python -m kernels.bench.moe --out moe.json            # check, then benchmark
    python -m kernels.bench.moe --tune --out moe.json     # check, tune, write configs, benchmark
    python -m kernels.bench.moe --tune warp --out moe.json  # retune only the warp-decode family

Shape: the Qwen3-30B-A3B MoE layer (H=2048, E=128, k=8, I=768), random bf16 weights for
several layers cycled so L2 cannot help. For each batch size: the floor (distinct experts
touched x 3*H*I*2 bytes over the measured read bandwidth), each path's time per layer under
CUDA graphs (median of many replays, each path timed twice), and each path's relative error
against a float64 reference, taken from a CUDA-graph replay (where the kernels overlap).
`--tune` sweeps block sizes for both paths, writes `kernels/configs/*.json` (and a copy to
--save-configs) and the crossover table the dispatcher reads, then benchmarks with what it
wrote.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from functools import partial
from pathlib import Path

import torch

from kernels import dispatch, reference, tuned
from kernels.bench.gpu_timing import graph_time_us, read_bandwidth
from kernels.fused_moe import fused_moe
from kernels.router import route as triton_route
from kernels.warp_decode import default_configs as warp_default_configs
from kernels.warp_decode import warp_decode_moe
from kernels.warp_decode_batched import MAX_TOKENS as BATCHED_MAX_TOKENS
from kernels.warp_decode_batched import warp_decode_batched_moe
from kernels.warp_decode_dedup import warp_decode_dedup_moe

QWEN3_30B_A3B = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}
BATCHES = (1, 2, 4, 8, 16, 32, 64)


class LayerSet:
    """Random bf16 weights (never zeros) for n_layers MoE layers of one shape, on the GPU."""

    def __init__(self, n_layers, hidden, inter, experts, top_k, seed=0, device="cuda"):
        self.n_layers, self.hidden, self.inter = n_layers, hidden, inter
        self.experts, self.top_k, self.device = experts, top_k, device
        gen = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape, scale):
            t = torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)
            return t.mul_(scale)

        self.w_gate_up = [
            randn(experts, 2 * inter, hidden, scale=hidden**-0.5) for _ in range(n_layers)
        ]
        self.w_down = [randn(experts, hidden, inter, scale=inter**-0.5) for _ in range(n_layers)]
        self.router = [randn(experts, hidden, scale=1.0) for _ in range(n_layers)]

    def inputs(self, batch, seed):
        """Per layer: x [B, H] bf16 and its routing (ids int64, weights fp32)."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        xs, ids, weights = [], [], []
        for layer in range(self.n_layers):
            x = torch.randn(
                batch, self.hidden, generator=gen, device=self.device, dtype=torch.bfloat16
            )
            i, w = reference.route(x, self.router[layer], self.top_k, norm_topk_prob=True)
            xs.append(x)
            ids.append(i.contiguous())
            weights.append(w.contiguous())
        return xs, ids, weights

    def layer_args(self, inputs, layer):
        xs, ids, weights = inputs
        return xs[layer], self.w_gate_up[layer], self.w_down[layer], ids[layer], weights[layer]


def float64_reference(x, w_gate_up, w_down, ids, weights, chunk=4):
    """moe_float64 a few tokens at a time (the gathered fp64 weights are large)."""
    parts = [
        reference.moe_float64(
            x[s : s + chunk], w_gate_up, w_down, ids[s : s + chunk], weights[s : s + chunk]
        )
        for s in range(0, x.shape[0], chunk)
    ]
    return torch.cat(parts)


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


@contextlib.contextmanager
def poisoned_outputs():
    """Fresh float buffers start as NaN, so an unwritten output element cannot pass a check."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real_empty


def check(log) -> bool:
    """Both paths and the router against the references at real and odd shapes."""
    ok = True
    shapes = [
        (1, QWEN3_30B_A3B),
        (3, QWEN3_30B_A3B),
        (64, QWEN3_30B_A3B),
        (5, {"hidden": 2000, "inter": 700, "experts": 60, "top_k": 6}),
    ]
    for batch, shape in shapes:
        layers = LayerSet(
            1, shape["hidden"], shape["inter"], shape["experts"], shape["top_k"], seed=batch
        )
        args = layers.layer_args(layers.inputs(batch, seed=batch + 100), 0)
        ref = float64_reference(*args)
        bf16_floor = rel_err(ref.to(torch.bfloat16), ref)
        stored = warp_default_configs(
            batch, shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
        )
        overlapped = {
            "gate_up": stored["gate_up"],
            "down": dict(stored["down"], pdl=True, prefetch=True),
        }
        with poisoned_outputs():
            errs = {
                "warp_decode": rel_err(warp_decode_moe(*args), ref),
                "warp_decode_overlap": rel_err(
                    graph_output(partial(warp_decode_moe, config=overlapped), args), ref
                ),
                "warp_decode_dedup": rel_err(warp_decode_dedup_moe(*args), ref),
                "expert_centric": rel_err(fused_moe(*args), ref),
            }
            if batch <= BATCHED_MAX_TOKENS:
                errs["warp_decode_batched"] = rel_err(warp_decode_batched_moe(*args), ref)
            x = args[0]
            ids, w = triton_route(x, layers.router[0], shape["top_k"], True)
        ref_ids, ref_w = reference.route(x, layers.router[0], shape["top_k"], True)
        # bf16 logits tie often; any tie order is a valid top-k, so compare the chosen weights
        # and check each chosen id's probability is the reported weight.
        probs = torch.softmax(torch.nn.functional.linear(x, layers.router[0]).float(), dim=-1)
        chosen = probs.gather(1, ids)
        chosen = chosen / chosen.sum(dim=1, keepdim=True)  # renormalised, as asked
        w_err = max((w - ref_w).abs().max().item(), (w - chosen).abs().max().item())
        same_ids = (ids == ref_ids).float().mean().item()
        good = all(e < 1e-2 and math.isfinite(e) for e in errs.values()) and w_err < 1e-5
        ok &= good
        log(
            f"check B={batch} {shape}: rel err {errs} (bf16 rounding {bf16_floor:.2e}); "
            f"router ids same order as torch {same_ids:.3f}, max weight diff {w_err:.1e} "
            f"-> {'ok' if good else 'FAIL'}"
        )
    return ok


def graph_output(fn, args):
    """fn(*args) as a CUDA-graph replay gives it (the kernels may overlap there)."""
    fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    out.fill_(float("nan"))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return out.clone()


def time_path(fn, layers, inputs, replays):
    n = layers.n_layers
    return graph_time_us(lambda: [fn(*layers.layer_args(inputs, l)) for l in range(n)], replays) / n


def crossover_entry(layers, rows, device_name):
    winners, max_tokens = {}, 0
    paths = (
        dispatch.WARP_DECODE,
        dispatch.WARP_DECODE_DEDUP,
        dispatch.WARP_DECODE_BATCHED,
        dispatch.EXPERT_CENTRIC,
    )
    for row in rows:
        timed = {p: row[f"{p}_us"] for p in paths if f"{p}_us" in row}
        winners[str(row["batch"])] = min(timed, key=timed.get)
    for row in rows:  # the longest run of warp-decode wins from the smallest batch
        if winners[str(row["batch"])] != dispatch.WARP_DECODE:
            break
        max_tokens = row["batch"]
    return {
        "device": device_name,
        "experts": layers.experts,
        "top_k": layers.top_k,
        "hidden": layers.hidden,
        "inter": layers.inter,
        "winners": winners,
        "warp_decode_max_tokens": max_tokens,
        "slots_per_expert": max(max_tokens, 1) * layers.top_k / layers.experts,
        "us_per_layer": {
            str(r["batch"]): {p: r[f"{p}_us"] for p in paths if f"{p}_us" in r} for r in rows
        },
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument(
        "--tune",
        nargs="?",
        const="all",
        choices=["all", "batched", "warp"],
        default=None,
        help="sweep block sizes and write configs first (all paths, only batched, or "
        "only warp decode's overlap and the deduplicated variant)",
    )
    parser.add_argument(
        "--no-batched",
        action="store_true",
        help="leave the batched variant out of the timings (keep its stored row)",
    )
    parser.add_argument(
        "--save-configs", type=Path, default=None, help="also copy config JSONs here"
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args(argv)
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU"
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    device_name = torch.cuda.get_device_name()
    batches = [int(b) for b in args.batches.split(",")]
    shape = QWEN3_30B_A3B
    log(f"{device_name}; torch {torch.__version__}; shape {shape}; {args.layers} layers")
    result = {"device": device_name, "shape": shape, "layers": args.layers, "batches": batches}

    if not args.skip_check:
        result["check_ok"] = check(log)

    bw = read_bandwidth()
    result["bandwidth"] = bw
    log(
        f"read bandwidth {bw['read_bytes_per_s'] / 1e12:.2f} TB/s "
        f"(copy, read+write: {bw['copy_bytes_per_s'] / 1e12:.2f} TB/s)"
    )

    layers = LayerSet(
        args.layers, shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    )
    inputs = {b: layers.inputs(b, seed=1000 + b) for b in batches}
    names = {
        f: tuned.shape_name(f, shape["hidden"], shape["inter"], shape["experts"], shape["top_k"])
        for f in ("warp_decode", "fused_moe", "warp_decode_batched", "warp_decode_dedup")
    }

    def save(name, data):
        data = {"device": device_name, "shape": shape, **data}
        tuned.save(name, data)
        if args.save_configs:
            tuned.save(name, data, args.save_configs)

    if args.tune == "warp":
        from kernels.bench import tune_moe
        from kernels.warp_decode import default_configs as warp_cfgs

        def cfgs(b):
            return warp_cfgs(b, shape["hidden"], shape["inter"], shape["experts"], shape["top_k"])

        small = [b for b in batches if b <= 16]  # where an output-centric path can win
        tune_moe.precompile(
            shape["hidden"],
            shape["inter"],
            shape["experts"],
            shape["top_k"],
            log,
            jobs=tune_moe.overlap_jobs(small, cfgs),
        )
        log("tuning warp decode overlap and the deduplicated variant")
        ov = tune_moe.tune_overlap(layers, small, inputs, cfgs, log=log)
        result["tuning_overlap_us"] = ov["us"]
        stored = tuned.load(names["warp_decode"]) or {}
        merged = dict(stored)  # other keys (the device) stay as they were
        merged.update(
            {
                part: {**stored.get(part, {}), **ov["warp_decode"][part]}
                for part in ("gate_up", "down")
            }
        )
        # The one-launch choice was timed with the old tiles: the retuned batches run the pair.
        retuned = ov["warp_decode"]["down"]
        merged["persistent"] = {
            b: n for b, n in stored.get("persistent", {}).items() if b not in retuned
        }
        save(names["warp_decode"], merged)
        save(names["warp_decode_dedup"], ov["warp_decode_dedup"])

    if args.tune in ("all", "batched"):
        from kernels.bench import tune_moe

        log("tuning batched warp decode")
        wb_tuned = tune_moe.tune_batched(layers, batches, inputs, log=log)
        save(names["warp_decode_batched"], {"configs": wb_tuned["configs"]})
        result["tuning_batched_us"] = wb_tuned["us"]

    if args.tune == "all":
        from kernels.bench import tune_moe

        tune_moe.precompile(shape["hidden"], shape["inter"], shape["experts"], shape["top_k"], log)
        log("tuning warp decode")
        wd_tuned = tune_moe.tune_warp_decode(layers, batches, inputs, log=log)
        log("tuning expert-centric")
        ec_tuned = tune_moe.tune_fused(layers, batches, inputs, log=log)
        result["tuning"] = {"warp_decode_us": wd_tuned["us"], "expert_centric_us": ec_tuned["us"]}
        save(names["warp_decode"], {"gate_up": wd_tuned["gate_up"], "down": wd_tuned["down"]})
        save(names["fused_moe"], {"configs": ec_tuned["configs"]})

    rows = []
    for batch in batches:
        ids = inputs[batch][1]
        distinct = sum(int(torch.unique(i).numel()) for i in ids) / layers.n_layers
        floor_bytes = distinct * 3 * shape["hidden"] * shape["inter"] * 2
        row = {
            "batch": batch,
            "distinct_experts": distinct,
            "floor_bytes": floor_bytes,
            "floor_us": floor_bytes / bw["read_bytes_per_s"] * 1e6,
        }
        paths = {
            "expert_centric": fused_moe,
            "warp_decode": warp_decode_moe,
            "warp_decode_dedup": warp_decode_dedup_moe,
        }
        if batch <= BATCHED_MAX_TOKENS and not args.no_batched:
            paths["warp_decode_batched"] = warp_decode_batched_moe
        for rep in (1, 2):
            for path, fn in paths.items():
                row[f"{path}_us_{rep}"] = time_path(fn, layers, inputs[batch], args.replays)
        for path in paths:
            row[f"{path}_us"] = min(row[f"{path}_us_1"], row[f"{path}_us_2"])
        layer0 = layers.layer_args(inputs[batch], 0)
        ref = float64_reference(*layer0)
        row["bf16_rounding_err"] = rel_err(ref.to(torch.bfloat16), ref)
        for path, fn in paths.items():
            row[f"{path}_err"] = rel_err(graph_output(fn, layer0), ref)
        rows.append(row)
        log(
            f"B={batch:3d} floor {row['floor_us']:6.1f}  ec {row['expert_centric_us_1']:6.1f}/"
            f"{row['expert_centric_us_2']:6.1f}  "
            f"wd {row['warp_decode_us_1']:6.1f}/{row['warp_decode_us_2']:6.1f}"
            f"  dedup {row['warp_decode_dedup_us_1']:6.1f}/{row['warp_decode_dedup_us_2']:6.1f}"
            f"  batched {row.get('warp_decode_batched_us_1', math.nan):6.1f}/"
            f"{row.get('warp_decode_batched_us_2', math.nan):6.1f}"
        )

    if args.tune:  # the crossover is re-measured whenever a path's configs change
        table = dict(tuned.load("crossover.json") or {})
        table[f"E{layers.experts}_k{layers.top_k}"] = crossover_entry(layers, rows, device_name)
        tuned.save("crossover.json", table)
        if args.save_configs:
            tuned.save("crossover.json", table, args.save_configs)

    for row in rows:
        batch = row["batch"]
        path = dispatch.choose_path(batch, layers.top_k, layers.experts)
        row["dispatch_path"] = path
        for rep in (1, 2):
            row[f"dispatch_us_{rep}"] = time_path(dispatch.moe, layers, inputs[batch], args.replays)
        row["dispatch_us"] = min(row["dispatch_us_1"], row["dispatch_us_2"])
        ref = float64_reference(*layers.layer_args(inputs[batch], 0))
        row["dispatch_err"] = rel_err(
            graph_output(dispatch.moe, layers.layer_args(inputs[batch], 0)), ref
        )

    result["rows"] = rows
    print_table(rows, log)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        log(f"wrote {args.out}")


def print_table(rows, log):
    log("us per layer (CUDA graph, median of replays, best of two timings); errors vs float64")
    header = (
        f"{'B':>3} {'experts':>7} {'floor':>7} {'expert-c':>9} {'warp-dec':>9} {'dedup':>8} "
        f"{'batched':>8} {'dispatch':>9} {'path':>19} {'floor/wd':>8} {'ec/wd':>6} {'err ec':>8} "
        f"{'err wd':>8} {'err dd':>8} {'err bat':>8} {'err dis':>8} {'bf16':>8}"
    )
    print(header)
    nan = math.nan
    for r in rows:
        print(
            f"{r['batch']:>3} {r['distinct_experts']:>7.1f} {r['floor_us']:>7.1f} "
            f"{r['expert_centric_us']:>9.1f} {r['warp_decode_us']:>9.1f} "
            f"{r['warp_decode_dedup_us']:>8.1f} {r.get('warp_decode_batched_us', nan):>8.1f} "
            f"{r['dispatch_us']:>9.1f} "
            f"{r['dispatch_path']:>19} {r['floor_us'] / r['warp_decode_us']:>8.2f} "
            f"{r['expert_centric_us'] / r['warp_decode_us']:>6.2f} {r['expert_centric_err']:>8.2e} "
            f"{r['warp_decode_err']:>8.2e} {r['warp_decode_dedup_err']:>8.2e} "
            f"{r.get('warp_decode_batched_err', nan):>8.2e} {r['dispatch_err']:>8.2e} "
            f"{r['bf16_rounding_err']:>8.2e}"
        )


if __name__ == "__main__":
    main()
