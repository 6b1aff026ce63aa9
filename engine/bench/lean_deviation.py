"""How far the lean CPU decode step's logits stray from the general path's, and why: greedy steps
on held-out files, teacher-forced with the general path's (fp32) picks, each step's lean logits
compared on the general path's best few. A step's closest routing decision (over its layers, the
gap between the last expert chosen and the first left out, in router logits) shows where a
routing flip, not rounding, moved the logits.

    python -m engine.bench.lean_deviation --model DIR --files 60 --steps 12 --out dev.json

Prints the moves' quantiles, and for pairs of thresholds (routing gap, top-2 logit gap) the share
of steps a guard deferring below them would send to fp32, and how many steps it would keep whose
top-2 gap their move could close (unsafe).

    python -m engine.bench.lean_deviation --model DIR --files 40 --steps 12 --per-layer

instead measures, layer by layer, how far the int4 step's routing strays from its own fp32
recompute's (the guard's, over the same cache) on greedy steps: the change in each layer's
closest routing gap, and the routing decisions that flipped, which is what a routing margin must
cover.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
from pathlib import Path

import torch

from engine.loading.loader import load_model
from engine.loading.tokenizer import Tokenizer
from engine.model import lean_cpu
from engine.model.options import ModelOptions
from engine.prompts.fim import build_fim_prompt

BEST = 5  # the general path's best logits each step's move is measured on


@contextlib.contextmanager
def watching_routing(top_k: int, keep_logits: bool = False):
    """The closest routing gap of each lean router call inside the block (or with
    `keep_logits`, its router logits), in a list."""
    seen: list = []
    original = lean_cpu._router_logits

    def recording(router, h):
        logits = original(router, h)
        seen.append(logits if keep_logits else lean_cpu.closest_route(logits, top_k))
        return logits

    lean_cpu._router_logits = recording
    try:
        yield seen
    finally:
        lean_cpu._router_logits = original


def prompts(heldout: Path, tok, n_files: int):
    """A FIM prompt per file: cut at the first line start past its middle."""
    with open(heldout) as f:
        docs = [json.loads(line) for _, line in zip(range(n_files), f)]
    for doc in docs:
        text = doc["text"]
        cut = text.find("\n", len(text) // 2) + 1 or len(text) // 2
        yield build_fim_prompt(tok, text[max(0, cut - 1500) : cut], text[cut : cut + 500], "spm")


@torch.inference_mode()
def measure(
    model_dir: Path, heldout: Path, n_files: int, steps: int, form: str, guarded: bool = False
) -> tuple[list[dict], float]:
    """Each teacher-forced step's move, and the share of steps the int4 guard computed again
    (0 unguarded)."""
    tok = Tokenizer.from_dir(model_dir)
    lean = load_model(model_dir, options=ModelOptions(lean_weights=form))
    lean.lean.guarded = guarded
    general = load_model(model_dir, options=ModelOptions(lean_decode=False))
    assert lean.lean_path_applies() and not general.lean_path_applies()
    out = []
    with watching_routing(lean.config.num_experts_per_tok) as routing:
        for ids in prompts(heldout, tok, n_files):
            out.extend(_steps(lean, general, ids, steps, routing))
    return out, lean.lean.recomputed / max(1, lean.lean.steps)


def _steps(lean, general, ids: list[int], steps: int, routing: list[float]) -> list[dict]:
    """One prompt's teacher-forced steps: the lean step's logits against the general path's."""
    out = []
    cache = lean.new_cache(1, capacity=len(ids) + steps + 1)
    seq = list(ids)
    logits = lean.forward(torch.tensor([seq]), torch.arange(len(seq))[None], cache, True)[0, -1]
    route = math.inf  # the prompt's forward is the general path's arithmetic
    for _ in range(steps):
        full = general.new_cache(1, capacity=len(seq))
        want = general.forward(torch.tensor([seq]), torch.arange(len(seq))[None], full)[0, -1]
        best = torch.topk(want, BEST)
        two = torch.topk(logits, 2)
        out.append(
            {
                "route": route,
                "gap": float(two.values[0] - two.values[1]),
                "move": float((logits[best.indices] - best.values).abs().max()),
                "flip": int(logits.argmax()) != int(best.indices[0]),
            }
        )
        seq.append(int(best.indices[0]))
        routing.clear()
        position = torch.tensor([[len(seq) - 1]])
        logits = lean.forward(torch.tensor([[seq[-1]]]), position, cache)[0, -1]
        route = min(routing, default=math.inf)
    return out


@torch.inference_mode()
def router_noise(model, ids: list[int], steps: int) -> list[list[dict]]:
    """Per layer, each greedy step's routing in the int4 lean step against the same step
    recomputed from fp32 weights (the guard's recompute), over one cache: the fp32 gap at the
    top-k boundary, its change, and whether the chosen experts differ."""
    lean = model.lean
    lean.prepare()
    top_k = model.config.num_experts_per_tok
    per_layer: list[list[dict]] = [[] for _ in range(model.config.num_layers)]
    cache = model.new_cache(1, capacity=len(ids) + steps + 1)
    logits = model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache, True)[0, -1]
    token, position = int(logits.argmax()), len(ids)
    for _ in range(steps):
        routed = {}
        # fp32 first: the int4 step's K/V are the ones left in the cache, as in guarded decoding.
        for name, layers in (("fp32", lean.exact_layers), ("int4", lean.layers)):
            with watching_routing(top_k, keep_logits=True) as seen:
                rows = cache.lean_rows(position, 1)
                logits = lean._forward(
                    [token], lean._rope(position, 1), lean_cpu.CacheRows(cache, rows), layers
                )[0]
            routed[name] = seen
        for layer, (exact, rounded) in enumerate(zip(routed["fp32"], routed["int4"])):
            exact, rounded = torch.tensor(exact[0]), torch.tensor(rounded[0])
            order = exact.argsort(descending=True)
            low, high = order[top_k], order[top_k - 1]
            gap = float(exact[high] - exact[low])
            per_layer[layer].append(
                {
                    "gap": gap,
                    "change": abs(gap - float(rounded[high] - rounded[low])),
                    "flip": set(order[:top_k].tolist())
                    != set(rounded.topk(top_k).indices.tolist()),
                }
            )
        token, position = int(logits.argmax()), position + 1
    return per_layer


def _quantile(ordered: list[float], q: float) -> float:
    """The q quantile of sorted values (the nearest rank at or below)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _per_layer_summary(per_layer: list[list[dict]]) -> list[dict]:
    """Per layer: the quantiles of the routing gap's change, the flips, and the near-ties (fp32
    gap under ROUTE_MARGIN)."""
    out = []
    for layer, rows in enumerate(per_layer):
        changes = sorted(r["change"] for r in rows)
        out.append(
            {
                "layer": layer,
                "steps": len(rows),
                "change_p50": _quantile(changes, 0.5),
                "change_p99": _quantile(changes, 0.99),
                "change_max": changes[-1],
                "flips": sum(r["flip"] for r in rows),
                "near_ties": sum(r["gap"] < lean_cpu.ROUTE_MARGIN for r in rows),
            }
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--heldout", type=Path, default=Path(".corpus/heldout.jsonl"))
    ap.add_argument("--files", type=int, default=60)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--form", default="auto", help="the lean step's weights (as ModelOptions)")
    ap.add_argument(
        "--guarded",
        action="store_true",
        help="measure the int4 step with its guard (engine.model.lean_cpu), which computes the "
        "steps that are not decisive again from fp32 weights; without it, the int4 step alone",
    )
    ap.add_argument(
        "--per-layer",
        action="store_true",
        help="the int4 step's routing against its fp32 recompute, layer by layer (int4 models)",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.per_layer:
        model = load_model(args.model, options=ModelOptions(lean_weights="int4"))
        tok = Tokenizer.from_dir(args.model)
        per_layer: list[list[dict]] = [[] for _ in range(model.config.num_layers)]
        for ids in prompts(args.heldout, tok, args.files):
            for layer, rows in enumerate(router_noise(model, ids, args.steps)):
                per_layer[layer].extend(rows)
        summary = _per_layer_summary(per_layer)
        print(json.dumps(summary, indent=1))
        if args.out:
            args.out.write_text(json.dumps(summary, indent=1))
        return 0
    rows, recomputed = measure(
        args.model, args.heldout, args.files, args.steps, args.form, args.guarded
    )
    stepped = [r for r in rows if r["route"] != math.inf]
    if not stepped:
        print("no lean decode steps were measured (is --steps at least 2?)")
        return 1
    moves = sorted(r["move"] for r in stepped)
    summary = {
        "steps": len(stepped),
        "flips": sum(r["flip"] for r in stepped),
        "move_p50": statistics.median(moves),
        "move_p99": _quantile(moves, 0.99),
        "move_max": moves[-1],
        "recomputed": recomputed,
        "guards": [],
    }
    for route_gap, logit_gap in ((0.005, 0.3), (0.01, 0.3), (0.005, 0.5), (0.01, 0.5)):
        kept = [r for r in stepped if r["route"] >= route_gap and r["gap"] >= logit_gap]
        summary["guards"].append(
            {
                "route_gap": route_gap,
                "logit_gap": logit_gap,
                "deferred": 1 - len(kept) / len(stepped),
                "unsafe_kept": sum(2 * r["move"] >= r["gap"] for r in kept),
                "largest_move_kept": max((r["move"] for r in kept), default=0.0),
            }
        )
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "steps": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
