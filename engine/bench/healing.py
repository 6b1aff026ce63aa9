"""What token healing costs the first token: time from submitting a completion to its first
released text, with the prompt warmed one keystroke earlier (as the server does on didChange),
with and without healing, on held-out files of the embedded model.

    python -m engine.bench.healing [--files 30]

Each file is cut at the indentation of its middle line (up to 3,000 characters of prefix, 1,000
of suffix); the completion stops at the newline (<= 24 tokens). Healing adds the decode steps that
write the healed text again before any text is released.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.core.engine import Engine
from engine.core.request import Request
from engine.loading.loader import load_model
from engine.loading.tokenizer import Tokenizer
from engine.models import default_model_dir
from engine.prompts.fim import healed_text
from engine.prompts.layout import fim_prompt_within


def cut_at_middle_line(text: str) -> tuple[str, str]:
    lines = text.split("\n")
    mid = len(lines) // 2
    start = sum(len(line) + 1 for line in lines[:mid])
    line = lines[mid]
    indent = line[: len(line) - len(line.lstrip())]
    return text[:start][-3000:] + indent, text[start + len(line) :][:1000]


def first_text_ms(engine: Engine, ids: list[int], forced: str) -> float:
    t0, first = time.perf_counter(), []

    def on_event(event) -> None:
        if event.kind == "delta" and event.text and not first:
            first.append(time.perf_counter())

    engine.complete(Request(ids, max_tokens=24, stop=("\n",), forced_text=forced), on_event).check()
    return 1000 * ((first[0] if first else time.perf_counter()) - t0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--files", type=int, default=30)
    args = ap.parse_args(argv)
    from engine.train import heldout  # the held-out list lives with the trainer

    torch.set_grad_enabled(False)
    model, tok = load_model(default_model_dir()), Tokenizer.from_dir(default_model_dir())
    context = model.config.max_position_embeddings
    times: dict[bool, list[float]] = {False: [], True: []}
    for _, text in heldout.load("python", limit=args.files):
        prefix, suffix = cut_at_middle_line(text)
        for heal in (False, True):
            engine = Engine(model, tok)
            # one keystroke earlier; prompts fit the model's context as the daemon's do
            warm = fim_prompt_within(tok, prefix[:-1], suffix, "spm", context, 24, heal=heal)
            engine.complete(Request(warm, warm_only=True))
            ids = fim_prompt_within(tok, prefix, suffix, "spm", context, 24, heal=heal)
            times[heal].append(first_text_ms(engine, ids, healed_text(tok, prefix) if heal else ""))
    for heal in (False, True):
        p50 = statistics.median(times[heal])
        name = "healed" if heal else "not healed"
        print(f"{name:>10}: first text p50 {p50:.1f} ms over {len(times[heal])} files")


if __name__ == "__main__":
    main()
