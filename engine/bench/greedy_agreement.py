"""How often the CPU's default decode step changes a greedy answer: held-out single-line FIM
tasks completed by the general path (prefill's arithmetic, fp32) and by the lean decode step
(engine.model.lean_cpu) in the form the options name, as the engine runs it and (int4) with its
optional guard; with --bf16 also by the general path in bf16. Each arm completes a task as
`wd-engine generate` runs a task (token healing, speculation, stop at the newline).

    python -m engine.bench.greedy_agreement --model DIR --files 60 --tasks-per-file 5

Prints, per arm, the answers that differ from the general path's, exact matches, and the time
spent completing (every arm in the same loop, task by task, so host drift hits all alike).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.core.engine import Engine
from engine.core.request import Request
from engine.loading.loader import load_model
from engine.loading.tokenizer import Tokenizer
from engine.model.options import ModelOptions
from engine.prompts.fim import healed_text
from engine.prompts.layout import fim_prompt_within

MAX_TOKENS = 24  # the single-line cap, as the eval and the language server use


def arms(model_dir: Path, form: str, bf16: bool = False) -> dict[str, tuple[object, bool]]:
    """Each arm's model and whether its lean step is guarded: the general path first (the
    reference), the lean step as the engine runs it by default (unguarded), and in the int4 form
    the same step with its guard (`--cpu-decode-guard`). `bf16`: the general path in bf16 too, as
    a GPU engine or transformers in bf16 computes the same weights: how far two legitimate
    arithmetics of one model disagree."""
    general = load_model(model_dir, options=ModelOptions(lean_decode=False))
    lean = load_model(model_dir, options=ModelOptions(lean_weights=form))
    assert lean.lean_path_applies() and not general.lean_path_applies()
    out = {"general": (general, False), "lean": (lean, False)}
    if bf16:
        general_bf16 = load_model(
            model_dir, torch.bfloat16, options=ModelOptions(lean_decode=False)
        )
        out["general-bf16"] = (general_bf16, False)
    if lean.lean.form == "int4":  # the guard's own arm (the guard means nothing elsewhere)
        out["lean-guarded"] = (lean, True)
    return out


def _complete(model, tok, prompt: list[int], forced: str) -> tuple[str, float]:
    request = Request(list(prompt), max_tokens=MAX_TOKENS, stop=("\n",), forced_text=forced)
    t0 = time.perf_counter()
    text = Engine.for_one_request(model, tok, request).complete(request).check().text
    return text, 1000 * (time.perf_counter() - t0)


@torch.inference_mode()
def measure(
    model_dir: Path,
    docs: list[tuple[str, str]],
    per_file: int,
    form: str = "auto",
    bf16: bool = False,
):
    """(summary, rows): each task's answer per arm, and per arm the answers that differ from the
    general path's, exact matches and milliseconds spent."""
    from engine.train.fim_tasks import make_tasks
    from engine.train.metrics import exact_match

    tok = Tokenizer.from_dir(model_dir)
    models = arms(model_dir, form, bf16)
    lean = models["lean"][0].lean
    context = lean.model.config.max_position_embeddings
    guarded_steps = guarded_recomputed = 0  # the guarded arm's (the arms share one counter)
    rows = []
    for task in make_tasks(docs, "single", 0, per_file):
        prompt = fim_prompt_within(
            tok, task.prefix, task.suffix, "spm", context, MAX_TOKENS, heal=True
        )
        forced = healed_text(tok, task.prefix)
        row = {"id": task.doc_id, "middle": task.middle}
        for name, (model, guarded) in models.items():
            if model.lean is not None:
                model.lean.guarded = guarded
            steps, recomputed = lean.steps, lean.recomputed
            text, ms = _complete(model, tok, prompt, forced)
            row[name] = {"text": text, "exact": exact_match(text, task.middle), "ms": ms}
            if guarded:
                guarded_steps += lean.steps - steps
                guarded_recomputed += lean.recomputed - recomputed
        rows.append(row)
    summary = {"tasks": len(rows)}
    for name in models:
        summary[name] = {
            "differ": sum(r[name]["text"] != r["general"]["text"] for r in rows),
            "exact": sum(r[name]["exact"] for r in rows),
            "ms": round(sum(r[name]["ms"] for r in rows)),
        }
    if "lean-guarded" in summary:
        recomputed = round(guarded_recomputed / max(1, guarded_steps), 3)
        summary["lean-guarded"]["recomputed"] = recomputed
    return summary, rows


def main(argv=None) -> int:
    from engine.train import heldout

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--lang", default="python")
    ap.add_argument("--files", type=int, default=60)
    ap.add_argument("--tasks-per-file", type=int, default=5)
    ap.add_argument("--form", default="auto", help="the lean step's weights (as ModelOptions)")
    ap.add_argument("--bf16", action="store_true", help="the general path in bf16 as an arm too")
    ap.add_argument("--out", type=Path, help="each task's answers, as JSON")
    args = ap.parse_args(argv)
    docs = heldout.load(args.lang, limit=args.files)
    if not docs:
        print("no held-out files found (build the corpus or install the listed sources)")
        return 1
    summary, rows = measure(args.model, docs, args.tasks_per_file, args.form, args.bf16)
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "tasks": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
