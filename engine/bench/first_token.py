"""First-token latency, cold against warm after one typed character.

    python -m engine.bench.first_token [--model DIR | --random] [--contexts 1024 4096 8192]

Cold: a fresh engine computes the whole prompt. Warm: the engine was warmed with the prompt as
it stood one keystroke earlier (suffix-first FIM, so the keystroke only appends), as the server
does while the user types, and the warm-up has finished on the device; the completion then
computes only the new tokens. Prompts are real
source text (this project's own files, then the standard library's). The prompts are not healed:
this measures the first sampled token; the server's token healing releases the first text about
one decode step later (`python -m engine.bench.healing`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
from pathlib import Path

import torch

from engine.core.engine import Engine
from engine.core.options import EngineOptions
from engine.core.request import Request
from engine.loading.loader import load_model
from engine.loading.tokenizer import Tokenizer
from engine.models import default_model_dir
from engine.prompts.fim import build_fim_prompt


def source_text(min_chars: int) -> str:
    """Enough real code: this project's sources, then standard-library modules."""
    import asyncio  # noqa: E401
    import collections
    import email
    import json as json_mod
    import logging
    import pathlib
    import typing

    root = Path(__file__).resolve().parents[2]
    parts = [
        p.read_text() for p in sorted(root.glob("*/**/*.py"))[:200] if p.stat().st_size < 200_000
    ]
    for module in (typing, collections, logging, pathlib, json_mod, email, asyncio):
        parts.append(inspect.getsource(module))
    text = "\n".join(parts)
    while len(text) < min_chars:
        text += text
    return text


def first_token_ms(engine: Engine, prompt_ids: list[int]) -> float:
    done = engine.complete(Request(prompt_ids, max_tokens=1, stop_at_eos=False)).check()
    return done.usage["first_token_ms"]


def settle(model) -> None:
    """Wait for the device's queued work: a warm-up returns once its prefill is queued, and the
    next keystroke comes tens of milliseconds later, when it has run. Without this wait the
    warm first token would include the warm-up's last kernels (about 16 ms of a 4K prefill on
    an H100)."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def ready_engine(model, tokenizer, options, warm_with: list[int] | None = None) -> Engine:
    """A fresh engine, warmed with `warm_with` (the prompt one keystroke earlier) if given, once
    the device has run everything queued."""
    engine = Engine(model, tokenizer, options)
    if warm_with is not None:
        engine.complete(Request(warm_with, warm_only=True))
    settle(model)
    return engine


def profile_requests(model, tokenizer, options, before, after, top: int) -> None:
    """Where a cold and a warm first token spend their time: torch's profiler over one request
    each, the costliest operations by device time (on CUDA), then by host time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    sort_keys = ["self_cpu_time_total"]
    if model.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        sort_keys.insert(0, "self_device_time_total")
    for name, warm_with in (("cold", None), ("warm", before)):
        engine = ready_engine(model, tokenizer, options, warm_with)
        with torch.profiler.profile(activities=activities) as prof:
            ms = first_token_ms(engine, after)
            settle(model)
        events = prof.key_averages()
        print(f"\n{name} first token, {len(after)} prompt tokens: {ms:.1f} ms under the profiler")
        for key in sort_keys:
            print(events.table(sort_by=key, row_limit=top, max_name_column_width=60))


def decode_rate(engine: Engine, prompt_ids: list[int], n: int) -> float:
    """Batch-1 decode tokens/s after the (cached) prompt: (n - 1) steps over their time."""
    usage = engine.complete(Request(prompt_ids, max_tokens=n, stop_at_eos=False)).check().usage
    return (n - 1) / ((usage["total_ms"] - usage["first_token_ms"]) / 1000)


def prompt_pair(tokenizer, text: str, n_tokens: int) -> tuple[list[int], list[int]]:
    """SPM prompts before and after typing one character at the cursor, about n_tokens long."""
    ids = tokenizer.encode(text[: n_tokens * 6])
    cut = tokenizer.decode(ids[: n_tokens - 40])
    suffix = "\n\n" + text[len(cut) : len(cut) + 120]
    before = build_fim_prompt(tokenizer, cut, suffix, "spm")
    after = build_fim_prompt(tokenizer, cut + "x", suffix, "spm")
    return before, after


DEFAULT_CONTEXTS = (1024, 4096, 8192)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="model folder (default: the embedded model)")
    ap.add_argument(
        "--random",
        action="store_true",
        help="random weights of the model's shape with a 16K context (for prompts past its own)",
    )
    ap.add_argument(
        "--shape",
        choices=("qwen3-30b-a3b",),
        help="random weights of a named real shape (the default model's tokenizer feeds it)",
    )
    ap.add_argument(
        "--quant",
        choices=("fp8", "int4"),
        help="with --shape or --random: projections quantized by the project's quantizer",
    )
    ap.add_argument(
        "--decode-tokens", type=int, default=32, help="also time this many decode steps (warm)"
    )
    ap.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        help=f"prompt lengths (default: those of {DEFAULT_CONTEXTS} within the model's context, "
        "else the longest prompt it takes with room for the decode steps)",
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", help="write results here")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, profile one cold and one warm request at the last context and print "
        "their N costliest operations by device and by host time",
    )
    args = ap.parse_args(argv)
    if args.quant and not (args.shape or args.random):
        ap.error("--quant needs --shape or --random (a model folder keeps its own format)")

    model_dir = Path(args.model) if args.model else default_model_dir()
    tokenizer = Tokenizer.from_dir(model_dir)
    if args.shape:
        from engine.loading.random_model import QWEN3_30B_A3B, random_model

        dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        model = random_model(QWEN3_30B_A3B, dtype=dtype, device=args.device, quant=args.quant)
        args.random = True
    elif args.random:
        from engine.loading.random_model import random_model

        cfg = json.loads((model_dir / "config.json").read_text())
        cfg["max_position_embeddings"] = max(16384, max(args.contexts or DEFAULT_CONTEXTS) + 64)
        dtype = torch.float32 if args.dtype == "auto" and args.device == "cpu" else torch.bfloat16
        model = random_model(cfg, dtype=dtype, device=args.device, quant=args.quant)
    else:
        model = load_model(model_dir, dtype=args.dtype, device=args.device)
    limit = model.config.max_position_embeddings
    contexts = args.contexts or [n for n in DEFAULT_CONTEXTS if n + 8 < limit] or [limit - 64]
    text = source_text(max(contexts) * 8)
    name = args.shape or model_dir.name
    print(
        f"model: {name}{' (random weights)' if args.random else ''}"
        f"{f', {args.quant} projections' if args.quant else ''}, device {args.device}, "
        f"{torch.get_num_threads()} threads, block {args.block_size}"
    )
    print(
        f"{'prompt':>8} {'cold ms':>10} {'warm ms':>10} {'speed-up':>9} {'new tok':>8} "
        f"{'decode tok/s':>13}"
    )
    results = []
    first_token_ms(
        Engine(model, tokenizer, EngineOptions(num_blocks=64, block_size=args.block_size)),
        tokenizer.encode(text[:2000]),
    )
    for n in contexts:
        if n + 8 >= limit:
            print(f"{n:>8}  skipped: the model's context is {limit}")
            continue
        before, after = prompt_pair(tokenizer, text, n)
        options = EngineOptions(
            num_blocks=2 * (len(after) // args.block_size + 4), block_size=args.block_size
        )
        cold, warm = [], []
        for _ in range(args.repeat):
            cold.append(first_token_ms(ready_engine(model, tokenizer, options), after))
            engine = ready_engine(model, tokenizer, options, warm_with=before)
            warm.append(first_token_ms(engine, after))
        row = dict(
            prompt_tokens=len(after),
            cold_ms=statistics.median(cold),
            warm_ms=statistics.median(warm),
            new_tokens=len(after) - engine.stats()["cache_hit_tokens"],
        )
        row["speedup"] = row["cold_ms"] / row["warm_ms"]
        row["decode_tok_s"] = (
            decode_rate(engine, after, args.decode_tokens) if args.decode_tokens else None
        )
        results.append(row)
        print(
            f"{row['prompt_tokens']:>8} {row['cold_ms']:>10.1f} {row['warm_ms']:>10.1f} "
            f"{row['speedup']:>8.1f}x "
            f"{row['new_tokens']:>8} {row['decode_tok_s'] or 0:>13.1f}"
        )
    if args.profile and results:
        profile_requests(model, tokenizer, options, before, after, args.profile)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                dict(
                    model=name,
                    random=args.random,
                    quant=args.quant,
                    device=args.device,
                    results=results,
                ),
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
