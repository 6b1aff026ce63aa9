"""Evaluate a model folder on the held-out files: FIM completion and bits per byte.

    python -m engine.train.eval --model engine/models/wd-coder-tiny [--files 100] [--json OUT]
    python -m engine.train.eval --model DIR --heldout .corpus/heldout.jsonl \\
        --heldout .corpus/heldout-debian.jsonl [--languages go,rust] [--files 50]

Held-out files: without `--heldout`, the original part's Python files: the tasks of every number
before the Debian part (same files, seed and tasks, pinned by tests/train/test_eval_languages.py).
`--heldout` (once per part: its built file or its name, heldout.py) takes every language of the
parts given; `--languages` keeps some (`go,rust`; `all`). `--files N` counts per language: the
first N files of each language in content-hash order over the parts together (a fixed
pseudo-random order, whatever order the parts come in), so neither a large part nor a large
language drowns the others; a language with fewer files gives all it has. Each task carries its
file's language (from the suffix, as the corpus named it: `.h` is C). Exact match (Wilson's
interval, or one counting files with several tasks) and edit similarity (Student's t across
files) come with 95% intervals per language and over all tasks, in the printed table and in the
JSON (`languages` under each kind and order); the overall numbers pool the tasks, so each
language weighs by its tasks (alike where each has N files). Bits per byte: overall and per
language. Where in a file a task may start follows its language (fim_tasks.py). Two models are
compared task by task (engine.train.compare) on runs with the same --heldout, --languages, --files,
--seed and --tasks-per-file; every `--details` row names its language.

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
from .corpus import LANG_BY_SUFFIX
from .data import load_tokenizer, token_byte_lengths
from .fim_tasks import PREFIX_CHARS, SUFFIX_CHARS, make_tasks
from .metrics import (
    clustered_interval,
    clustered_mean_interval,
    edit_similarity,
    exact_match,
    wilson_interval,
)

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
        cpu_decode_weights: str = "auto",
        cpu_decode_guard: bool = False,
    ):
        from engine.core.engine import Engine
        from engine.core.options import EngineOptions
        from engine.loading.loader import load_model
        from engine.loading.tokenizer import Tokenizer
        from engine.model.options import ModelOptions
        from engine.prompts.fim import healed_text
        from engine.prompts.layout import (
            MAX_PROMPT_TOKENS,
            build_completion_prompt,
            fim_prompt_within,
            prompt_budget,
        )

        options = ModelOptions(lean_weights=cpu_decode_weights, lean_guard=cpu_decode_guard)
        self.model = load_model(model_dir, options=options)
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


def bits_per_byte(backend, docs, model_dir: Path, max_tokens: int) -> tuple[float, dict]:
    """Left-to-right nats over the bytes of the predicted tokens (each ByteLevel character is one
    byte): over all files, and per language."""
    byte_len = token_byte_lengths(load_tokenizer(model_dir / "tokenizer.json"))
    nats, n_bytes = 0.0, 0
    by_lang: dict[str, list] = {}  # language -> [nats, bytes]
    for doc_id, text in docs:
        ids = backend.encode(text)[:max_tokens]
        if len(ids) < 2:
            continue
        logits = backend.logits(ids)
        targets = torch.tensor(ids[1:])
        doc_nats = F.cross_entropy(logits[:-1].float(), targets, reduction="sum").item()
        doc_bytes = int(byte_len[targets].sum())
        nats += doc_nats
        n_bytes += doc_bytes
        lang = by_lang.setdefault(heldout.language(doc_id), [0.0, 0])
        lang[0] += doc_nats
        lang[1] += doc_bytes
    per_lang = {lg: a / math.log(2) / b for lg, (a, b) in sorted(by_lang.items()) if b}
    return nats / math.log(2) / n_bytes, per_lang


def interval(hits: int, n: int, by_file: dict[str, list]) -> tuple[float, float]:
    """Wilson's interval for one task per file; with several, one that counts their correlation.
    by_file: file -> [hits, tasks, ...]."""
    if all(row[1] == 1 for row in by_file.values()):
        return wilson_interval(hits, n)
    return clustered_interval(
        [row[0] for row in by_file.values()], [row[1] for row in by_file.values()]
    )


def summarize(by_file: dict[str, list]) -> dict:
    """Exact match and edit similarity, with their 95% intervals, of the tasks of these files
    (file -> [exact hits, tasks, edit similarity summed])."""
    hits = sum(row[0] for row in by_file.values())
    n = sum(row[1] for row in by_file.values())
    es = sum(row[2] for row in by_file.values())
    es_ci = clustered_mean_interval(
        [row[2] for row in by_file.values()], [row[1] for row in by_file.values()]
    )
    return {
        "files": len(by_file),
        "tasks": n,
        "exact_match": round(hits / n, 4),
        "exact_match_ci95": [round(x, 4) for x in interval(hits, n, by_file)],
        "edit_similarity": round(es / n, 4),
        "edit_similarity_ci95": [round(x, 4) for x in es_ci],
    }


def table(kind: str, order: str, row: dict) -> str:
    """The printed table of one kind and order: a line per language, then all tasks."""

    def ci(pair):
        return f"[{pair[0]:.3f}, {pair[1]:.3f}]"

    lines = [
        f"{kind} {order}: {row['tasks']} tasks, p50 {row['p50_latency_ms']} ms, {row['seconds']} s",
        f"{'language':<12}{'files':>6}{'tasks':>7}  {'exact':>6} {'95% interval':<16}"
        f"  {'edit sim':>8} {'95% interval':<16}",
    ]
    rows = [*row["languages"].items(), ("all", row)]
    for name, r in rows:
        lines.append(
            f"{name:<12}{r['files']:>6}{r['tasks']:>7}  {r['exact_match']:>6.3f} "
            f"{ci(r['exact_match_ci95']):<16}  {r['edit_similarity']:>8.3f} "
            f"{ci(r['edit_similarity_ci95']):<16}"
        )
    return "\n".join(lines)


def select_docs(
    parts: list[str] | None,
    languages: list[str] | None,
    n_files: int,
    allow_changed: bool,
    corpus: Path = Path(".corpus"),
) -> list[tuple[str, str]]:
    """The eval's held-out files: `parts` (built files or names; None: the original part) and
    `languages` (None: Python without `parts`, every language with them; "all": every language),
    the first `n_files` of each language."""
    try:
        chosen = [heldout.part(spec, corpus) for spec in parts or [heldout.ORIGINAL]]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if languages is None:
        languages = None if parts else ["python"]
    elif "all" in languages:
        languages = None
    wanted = set(languages) if languages is not None else None
    unknown = sorted((wanted or set()) - set(LANG_BY_SUFFIX.values()))
    if unknown:
        raise SystemExit(f"unknown language {', '.join(unknown)}")
    docs = heldout.load_parts(chosen, wanted, corpus, allow_changed, per_language=n_files)
    missing = sorted((wanted or set()) - {heldout.language(doc_id) for doc_id, _ in docs})
    if missing and docs:
        raise SystemExit(f"no held-out files in {', '.join(missing)} in the parts given")
    return docs


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
    parts: list[str] | None = None,
    languages: list[str] | None = None,
    cpu_decode_weights: str = "auto",
    cpu_decode_guard: bool = False,
) -> dict:
    docs = select_docs(parts, languages, n_files, allow_changed)
    if not docs:
        raise SystemExit("no held-out files found (build the corpus or install the listed sources)")
    t0 = time.time()
    if beams > 1 and backend_name != "engine":
        raise SystemExit("--beams runs through the engine only")
    if layout == "server" and backend_name != "engine":
        raise SystemExit("--layout server runs through the engine only")
    backend = (
        EngineBackend(
            model_dir, heal, beams, layout, server_max_tokens, cpu_decode_weights, cpu_decode_guard
        )
        if backend_name == "engine"
        else TransformersBackend(model_dir)
    )
    files_per_language: dict[str, int] = {}
    for doc_id, _ in docs:
        lang = heldout.language(doc_id)
        files_per_language[lang] = files_per_language.get(lang, 0) + 1
    result = {
        "model": model_dir.name,
        "backend": backend_name,
        "heldout": [heldout.part(spec).name for spec in parts or [heldout.ORIGINAL]],
        "files": len(docs),
        "files_per_language": dict(sorted(files_per_language.items())),
        "seed": seed,
        "tasks_per_file": tasks_per_file,
        "single_line_beams": beams,
        "context_chars": [prefix_chars, suffix_chars],
        "layout": layout,
        **({"server_max_tokens": server_max_tokens} if layout == "server" else {}),
        "token_healing": heal and backend_name == "engine",
        **({"cpu_decode_weights": cpu_decode_weights} if cpu_decode_weights != "auto" else {}),
        **({"cpu_decode_guard": True} if cpu_decode_guard else {}),
        "load_s": round(time.time() - t0, 3),
    }
    for kind in kinds:
        tasks = make_tasks(docs, kind, seed, tasks_per_file, prefix_chars, suffix_chars)
        for order in orders:
            t1 = time.time()
            latencies = []
            by_file: dict[str, list] = {}  # file -> [hits, tasks, edit similarity summed]
            lang_of: dict[str, str] = {}  # file -> language
            for task in tasks:
                t2 = time.perf_counter()
                pred = backend.fim(task.prefix, task.suffix, order, kind)
                latencies.append(time.perf_counter() - t2)
                hit = exact_match(pred, task.middle)
                per_file = by_file.setdefault(task.file, [0, 0, 0.0])
                per_file[0] += hit
                per_file[1] += 1
                per_file[2] += edit_similarity(pred, task.middle)
                lang_of[task.file] = task.lang
                if details is not None:  # per task, so two models can be compared task by task
                    details.write(
                        json.dumps(
                            {
                                "kind": kind,
                                "order": order,
                                "task": task.doc_id,
                                "lang": task.lang,
                                "middle": task.middle,
                                "pred": pred,
                                "exact": bool(hit),
                            }
                        )
                        + "\n"
                    )
            row = result[f"{kind}_{order}"] = {
                **summarize(by_file),
                "p50_latency_ms": round(1000 * statistics.median(latencies), 1),
                "seconds": round(time.time() - t1, 1),
                "languages": {
                    lang: summarize({f: r for f, r in by_file.items() if lang_of[f] == lang})
                    for lang in sorted(set(lang_of.values()))
                },
            }
            print(table(kind, order, row), flush=True)
    if bpb_tokens:
        bpb, bpb_by_lang = bits_per_byte(backend, docs, model_dir, bpb_tokens)
        result["bits_per_byte"] = round(bpb, 4)
        result["bits_per_byte_by_language"] = {lg: round(v, 4) for lg, v in bpb_by_lang.items()}
        result["bpb_tokens_per_file"] = bpb_tokens
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--backend", choices=["engine", "transformers"], default="engine")
    ap.add_argument(
        "--heldout",
        action="append",
        metavar="PART",
        help="a held-out part, by its built file (.corpus/heldout-debian.jsonl) or its name "
        "(heldout-debian); once per part (default: the original part's Python files)",
    )
    ap.add_argument(
        "--languages",
        help="comma-separated languages to keep (python,go; all) (default: every language of "
        "the --heldout parts; Python without --heldout)",
    )
    ap.add_argument(
        "--files",
        type=int,
        default=100,
        help="held-out files per language (the first in content-hash order over the parts)",
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
    ap.add_argument(
        "--cpu-decode-weights",
        choices=("auto", "fp32", "int8", "int4"),
        default="auto",
        help="the weights the engine's lean CPU decode step streams (as wd-engine's option)",
    )
    ap.add_argument(
        "--cpu-decode-guard",
        action="store_true",
        help="int4 CPU decode steps that are not decisive computed again in fp32 (as wd-engine's)",
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
                parts=args.heldout,
                languages=args.languages.split(",") if args.languages else None,
                cpu_decode_weights=args.cpu_decode_weights,
                cpu_decode_guard=args.cpu_decode_guard,
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
