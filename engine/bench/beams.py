"""Greedy against beam search on held-out single-line FIM tasks, through the daemon's engine.

    python -m engine.bench.beams [--model DIR] [--tasks 60] [--beams 4]

Each task is a cold completion (a fresh prefix cache), as the eval cuts it (engine.train.fim_tasks):
the greedy request (prompt-lookup speculation on, as the daemon runs it) and the beam request
alternate, so host drift hits both alike. Prints time from submit to the last text (p50, p90,
sum) and exact matches of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.core.engine import Engine
from engine.core.request import Request
from engine.ipc.protocol import MAX_BEAMS
from engine.loading.loader import load_model
from engine.loading.tokenizer import Tokenizer
from engine.models import default_model_dir
from engine.prompts.fim import healed_text
from engine.prompts.layout import fim_prompt_within


def timed_completion(
    engine: Engine, prompt: list[int], forced: str, beams: int
) -> tuple[str, float]:
    t0 = time.perf_counter()
    request = Request(prompt, max_tokens=24, stop=("\n",), forced_text=forced, beams=beams)
    done = engine.complete(request).check()
    return done.text, 1000 * (time.perf_counter() - t0)


def main(argv=None) -> None:
    from engine.train import heldout
    from engine.train.fim_tasks import make_tasks
    from engine.train.metrics import exact_match

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tasks", type=int, default=60)
    ap.add_argument("--beams", type=int, default=4)
    args = ap.parse_args(argv)
    if not 2 <= args.beams <= MAX_BEAMS:
        ap.error(f"--beams must be within 2..{MAX_BEAMS} (1 is the greedy baseline itself)")
    model_dir = args.model or default_model_dir()
    torch.set_num_threads(
        1
    )  # the engine's decode steps run on one thread; prefill as the daemon's would on a busy host
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    tasks = make_tasks(heldout.load("python", limit=300), "single", 0, 5)[: args.tasks]
    times = {1: [], args.beams: []}
    hits = {1: 0, args.beams: 0}
    for i, task in enumerate(tasks):
        # as the eval prompts: fitted to the model's context
        prompt = fim_prompt_within(
            tok,
            task.prefix,
            task.suffix,
            "spm",
            model.config.max_position_embeddings,
            24,
            heal=True,
        )
        forced = healed_text(tok, task.prefix)
        for beams in (1, args.beams) if i % 2 == 0 else (args.beams, 1):
            engine = Engine(model, tok)  # nothing cached
            text, ms = timed_completion(engine, prompt, forced, beams)
            times[beams].append(ms)
            hits[beams] += exact_match(text, task.middle)
    report = {}
    for beams, ms in times.items():
        ms.sort()
        report[f"beams_{beams}"] = {
            "exact": hits[beams],
            "p50_ms": round(statistics.median(ms), 1),
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 1),
            "sum_ms": round(sum(ms)),
        }
    report["tasks"] = len(tasks)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
