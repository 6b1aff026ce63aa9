"""Evaluate a model folder on the held-out files: FIM completion and bits per byte.

    python -m engine.train.eval --model engine/models/wd-coder-tiny [--files 100] [--json OUT]

Single-line FIM (stop at the newline, <= 24 new tokens) and multi-line FIM (<= 96 new tokens,
stop at end of middle), greedy (`--beams N`: single lines by beam search, as the server asks),
in PSM and SPM order; exact match and edit similarity. Bits per byte: left-to-right loss over
the first --bpb-tokens tokens of each file. Runs through the project's engine, one request at a
time as the daemon runs it (prompt-lookup speculation included; no prefix cache, so no task's
answer depends on the tasks before it), with token healing at the cursor as the server does
(`--no-heal`: without); `--backend transformers` runs the same tasks through Hugging Face
instead (without healing). Tasks keep 2,000 characters of prefix and 1,000 of suffix (the eval's
numbers since the first model); `--layout server` lays them out as the engine daemon does for a
request of `--server-max-tokens` (what the language server sends the model:
`python -m wd_lsp.bench.editor_eval`, which passes its own budget and max_tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.ipc.protocol import MAX_BEAMS, CompletionParams

from . import heldout
from .data import load_tokenizer, token_byte_lengths
from .fim_tasks import PREFIX_CHARS, SUFFIX_CHARS, make_tasks
from .metrics import clustered_interval, edit_similarity, exact_match, wilson_interval

MAX_NEW = {"single": 24, "multi": 96}
STOPS = {"single": ["\n"], "multi": []}
# --layout server: a completion request's max_tokens where it gives none (the protocol's default).
SERVER_MAX_TOKENS = CompletionParams.max_tokens


class EngineBackend:
    def __init__(
        self,
        model_dir: Path,
        heal: bool = True,
        beams: int = 1,
        layout: str = "eval",
        server_max_tokens: int = SERVER_MAX_TOKENS,
    ):
        from engine.core.engine import Engine
        from engine.core.options import EngineOptions
        from engine.loading.loader import load_model
        from engine.loading.tokenizer import Tokenizer
        from engine.prompts.fim import healed_text
        from engine.prompts.layout import (
            MAX_PROMPT_TOKENS,
            build_completion_prompt,
            fim_prompt_within,
            prompt_budget,
        )

        self.model = load_model(model_dir)
        self.tok = Tokenizer.from_dir(model_dir)
        self.context = self.model.config.max_position_embeddings
        # Requests one at a time: a pool for one context; no prefix cache, so that a task's
        # answer never depends on the tasks before it.
        options = EngineOptions.holding(self.context, prefix_cache=False)
        self.engine = Engine(self.model, self.tok, options)
        self._healed = healed_text
        self._server_prompt, self._fim_prompt = build_completion_prompt, fim_prompt_within
        self.heal = heal
        self.beams = beams  # single-line tasks only: what the language server asks for
        # server: the daemon's budget for the language server's request (its max_tokens)
        self.server_budget = (
            prompt_budget(self.context, server_max_tokens, MAX_PROMPT_TOKENS)
            if layout == "server"
            else None
        )

    def _prompt_ids(self, prefix: str, suffix: str, order: str, kind: str) -> list[int]:
        """server: the prompt the engine daemon builds for the language server's request (the
        suffix cut to its token cap, then the prefix's end, within what the model's context leaves
        after the server's max_tokens). eval: the whole suffix and as much of the prefix's end as
        the context leaves after this task's new tokens (all of it for most tasks)."""
        if self.server_budget is not None:
            return self._server_prompt(
                self.tok,
                prefix,
                suffix,
                order=order,
                max_prompt_tokens=self.server_budget,
                repo_context=False,
                heal=self.heal,
            )
        return self._fim_prompt(
            self.tok, prefix, suffix, order, self.context, MAX_NEW[kind], heal=self.heal
        )

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def fim(self, prefix: str, suffix: str, order: str, kind: str) -> str:
        from engine.core.request import Request

        ids = self._prompt_ids(prefix, suffix, order, kind)
        forced = self._healed(self.tok, prefix) if self.heal else ""
        request = Request(
            ids,
            max_tokens=MAX_NEW[kind],
            temperature=0.0,
            stop=tuple(STOPS[kind]),
            forced_text=forced,
            beams=self.beams if kind == "single" else 1,
        )
        return self.engine.complete(request).check().text

    def logits(self, ids: list[int]) -> torch.Tensor:
        cache = self.model.new_cache(1, capacity=len(ids))
        tokens = torch.tensor([ids])
        return self.model.forward(tokens, torch.arange(len(ids))[None], cache)[0]


class TransformersBackend:
    def __init__(self, model_dir: Path):
        from transformers import Qwen3MoeForCausalLM

        from .fim_format import fim_prompt_ids

        self.model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tok = load_tokenizer(model_dir / "tokenizer.json")
        self._prompt = fim_prompt_ids
        # The engine's rule for control tokens, so both backends end alike.
        from engine.loading.tokenizer import Tokenizer

        rules = Tokenizer.from_dir(model_dir)
        self.ending, self.unsampled = list(rules.eos_ids), list(rules.unsampled_ids)
        self.eos = self.tok.token_to_id("<|endoftext|>")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    @torch.no_grad()
    def fim(self, prefix: str, suffix: str, order: str, kind: str) -> str:
        ids = self._prompt(self.encode, self.tok.token_to_id, prefix, suffix, order)
        excess = len(ids) - (self.model.config.max_position_embeddings - MAX_NEW[kind] - 1)
        if excess > 0:  # the prefix's start goes (at a token; the engine backend drops whole lines)
            kept = self.encode(prefix)[excess:]
            ids = self._prompt(
                lambda text: kept if text == prefix else self.encode(text),
                self.tok.token_to_id,
                prefix,
                suffix,
                order,
            )
        out = self.model.generate(
            torch.tensor([ids]),
            max_new_tokens=MAX_NEW[kind],
            do_sample=False,
            eos_token_id=self.ending,
            pad_token_id=self.eos,
            suppress_tokens=self.unsampled or None,
        )[0, len(ids) :].tolist()
        out = out[: next((i for i, t in enumerate(out) if t in self.ending), len(out))]
        text = self.tok.decode(out, skip_special_tokens=False)
        for stop in STOPS[kind]:
            text = text.split(stop)[0]
        return text

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids])).logits[0].float()


def bits_per_byte(backend, docs, model_dir: Path, max_tokens: int) -> float:
    """Left-to-right nats over the bytes of the predicted tokens (each ByteLevel character is one
    byte)."""
    byte_len = token_byte_lengths(load_tokenizer(model_dir / "tokenizer.json"))
    nats, n_bytes = 0.0, 0
    for _, text in docs:
        ids = backend.encode(text)[:max_tokens]
        if len(ids) < 2:
            continue
        logits = backend.logits(ids)
        targets = torch.tensor(ids[1:])
        nats += F.cross_entropy(logits[:-1].float(), targets, reduction="sum").item()
        n_bytes += int(byte_len[targets].sum())
    return nats / math.log(2) / n_bytes


def interval(hits: int, n: int, by_file: dict[str, list[int]]) -> tuple[float, float]:
    """Wilson's interval for one task per file; with several, one that counts their correlation."""
    if all(tasks == 1 for _, tasks in by_file.values()):
        return wilson_interval(hits, n)
    return clustered_interval([h for h, _ in by_file.values()], [t for _, t in by_file.values()])


def run(
    model_dir: Path,
    backend_name: str,
    n_files: int,
    orders: list[str],
    bpb_tokens: int,
    allow_changed: bool,
    seed: int = 0,
    kinds: tuple[str, ...] = ("single", "multi"),
    heal: bool = True,
    tasks_per_file: int = 1,
    details=None,
    beams: int = 1,
    prefix_chars: int = PREFIX_CHARS,
    suffix_chars: int = SUFFIX_CHARS,
    layout: str = "eval",
    server_max_tokens: int = SERVER_MAX_TOKENS,
) -> dict:
    docs = heldout.load("python", allow_changed=allow_changed, limit=n_files)
    if not docs:
        raise SystemExit("no held-out files found (build the corpus or install the listed sources)")
    t0 = time.time()
    if beams > 1 and backend_name != "engine":
        raise SystemExit("--beams runs through the engine only")
    if layout == "server" and backend_name != "engine":
        raise SystemExit("--layout server runs through the engine only")
    backend = (
        EngineBackend(model_dir, heal, beams, layout, server_max_tokens)
        if backend_name == "engine"
        else TransformersBackend(model_dir)
    )
    result = {
        "model": model_dir.name,
        "backend": backend_name,
        "files": len(docs),
        "seed": seed,
        "tasks_per_file": tasks_per_file,
        "single_line_beams": beams,
        "context_chars": [prefix_chars, suffix_chars],
        "layout": layout,
        **({"server_max_tokens": server_max_tokens} if layout == "server" else {}),
        "token_healing": heal and backend_name == "engine",
        "load_s": round(time.time() - t0, 3),
    }
    for kind in kinds:
        tasks = make_tasks(docs, kind, seed, tasks_per_file, prefix_chars, suffix_chars)
        for order in orders:
            t1 = time.time()
            em, es = 0, 0.0
            latencies = []
            by_file: dict[str, list[int]] = {}  # file -> [hits, tasks]
            for task in tasks:
                t2 = time.perf_counter()
                pred = backend.fim(task.prefix, task.suffix, order, kind)
                latencies.append(time.perf_counter() - t2)
                hit = exact_match(pred, task.middle)
                em += hit
                per_file = by_file.setdefault(task.file, [0, 0])
                per_file[0] += hit
                per_file[1] += 1
                es += edit_similarity(pred, task.middle)
                if details is not None:  # per task, so two models can be compared task by task
                    details.write(
                        json.dumps(
                            {
                                "kind": kind,
                                "order": order,
                                "task": task.doc_id,
                                "middle": task.middle,
                                "pred": pred,
                                "exact": bool(hit),
                            }
                        )
                        + "\n"
                    )
            result[f"{kind}_{order}"] = {
                "tasks": len(tasks),
                "exact_match": round(em / len(tasks), 4),
                "exact_match_ci95": [round(x, 4) for x in interval(em, len(tasks), by_file)],
                "edit_similarity": round(es / len(tasks), 4),
                "p50_latency_ms": round(1000 * statistics.median(latencies), 1),
                "seconds": round(time.time() - t1, 1),
            }
            print(kind, order, result[f"{kind}_{order}"], flush=True)
    if bpb_tokens:
        result["bits_per_byte"] = round(bits_per_byte(backend, docs, model_dir, bpb_tokens), 4)
        result["bpb_tokens_per_file"] = bpb_tokens
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--backend", choices=["engine", "transformers"], default="engine")
    ap.add_argument(
        "--files", type=int, default=100, help="held-out Python files to use (in list order)"
    )
    ap.add_argument("--orders", default="psm,spm")
    ap.add_argument("--kinds", default="single,multi")
    ap.add_argument("--bpb-tokens", type=int, default=1024, help="0 skips bits per byte")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tasks-per-file",
        type=int,
        default=1,
        help="FIM tasks cut from each file, at distinct lines (more tasks, a tighter interval)",
    )
    ap.add_argument(
        "--allow-changed", action="store_true", help="use files whose content differs from the list"
    )
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument(
        "--no-heal", action="store_true", help="prompt with the whole prefix, no token healing"
    )
    ap.add_argument(
        "--beams",
        type=int,
        default=1,
        help="single-line tasks by beam search over this many hypotheses, as the server asks "
        "(default: greedy)",
    )
    ap.add_argument(
        "--prefix-chars",
        type=int,
        default=PREFIX_CHARS,
        help="prefix kept before the cursor, cut at a line start (what the language server sends: "
        "python -m wd_lsp.bench.editor_eval)",
    )
    ap.add_argument(
        "--suffix-chars",
        type=int,
        default=SUFFIX_CHARS,
        help="suffix kept after the cursor, cut at a line end",
    )
    ap.add_argument(
        "--layout",
        choices=["eval", "server"],
        default="eval",
        help="eval: the whole trimmed prefix and suffix; server: the prompt the engine daemon "
        "builds, cut to the model's context and the suffix's token cap",
    )
    ap.add_argument(
        "--server-max-tokens",
        type=int,
        default=SERVER_MAX_TOKENS,
        help="--layout server: the max_tokens of the request the daemon lays the prompt out for "
        "(default: the protocol's)",
    )
    ap.add_argument(
        "--details",
        type=Path,
        help="write every task's completion and exact match here (JSON lines)",
    )
    args = ap.parse_args(argv)
    if args.tasks_per_file < 1:
        ap.error("--tasks-per-file must be at least 1")
    if not 1 <= args.beams <= MAX_BEAMS:
        ap.error(f"--beams must be within 1..{MAX_BEAMS}")
    details = open(args.details, "w") if args.details else None
    try:
        with torch.no_grad():  # scoped: tests call main() in-process, next to training
            result = run(
                args.model,
                args.backend,
                args.files,
                args.orders.split(","),
                args.bpb_tokens,
                args.allow_changed,
                args.seed,
                tuple(args.kinds.split(",")),
                heal=not args.no_heal,
                tasks_per_file=args.tasks_per_file,
                details=details,
                beams=args.beams,
                prefix_chars=args.prefix_chars,
                suffix_chars=args.suffix_chars,
                layout=args.layout,
                server_max_tokens=args.server_max_tokens,
            )
    finally:
        if details:
            details.close()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
