"""Completion prompts laid out so that the prefix cache stays warm while the user types.

Order, most stable first:
  1. extra context chunks (other files: definitions, imports), each `<|file_sep|>path\\ntext`,
  2. then, when the model supports suffix-first FIM (SPM): suffix, then prefix, then the middle
     marker — typing at the cursor only appends to the prompt, so every earlier block stays a
     cache hit; otherwise PSM with the suffix bounded, so a change in the suffix invalidates
     only what follows the prefix.
A token budget is enforced here: the suffix keeps its start, the prefix keeps its end (whole
lines go from its start in steps, so the cut stays put while the user types), the context chunks
go first when space runs out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.fim import FILE_SEP, fim_token_ids
from engine.token_healing import token_healer


@dataclass(frozen=True)
class ContextChunk:
    path: str
    text: str


def supported_fim_orders(model_dir: str | Path) -> tuple[str, ...]:
    """FIM orders a model was trained with: `fim_orders` in tokenizer_config.json, else PSM only
    (the Qwen-Coder format)."""
    path = Path(model_dir) / "tokenizer_config.json"
    if path.is_file():
        orders = json.loads(path.read_text()).get("fim_orders")
        if orders:
            return tuple(o for o in orders if o in ("psm", "spm")) or ("psm",)
    return ("psm",)


def uses_repo_context(model_dir: str | Path) -> bool:
    """Whether the model was trained with repository context (`<|file_sep|>path` blocks before
    the FIM body, as Qwen2.5/3-Coder were): `repo_context` in tokenizer_config.json, else whether
    its vocabulary has `<|repo_name|>`. A model without it gets the bare FIM body: text it never
    saw in training only confuses it."""
    path = Path(model_dir) / "tokenizer_config.json"
    if path.is_file():
        cfg = json.loads(path.read_text())
        if "repo_context" in cfg:
            return bool(cfg["repo_context"])
    tokenizer_json = Path(model_dir) / "tokenizer.json"
    return tokenizer_json.is_file() and '"<|repo_name|>"' in tokenizer_json.read_text()


# Where a prefix is too long for the budget, whole lines go from its start in steps of this many,
# so the start stays put while the user types (and the prefix cache stays warm) until the next
# step is needed; a cut at an exact token count would move with every keystroke.
PREFIX_CUT_LINES = 16


def _fit_prefix(tokenizer, prefix: str, prefix_ids: list[int], room: int, heal: bool) -> list[int]:
    """The prefix's ids within `room` tokens, without the fewest whole lines from its start that
    fit, counted in steps of PREFIX_CUT_LINES; where a step would leave over a quarter of the room
    unused (long lines), or no whole step fits, in single lines. A prefix whose cursor line alone
    is too long is cut at an exact token count."""
    if room <= 0:
        return []
    lines = prefix.split("\n")  # the last is the cursor's line, kept whole
    # The healer caches its last split for the engine's healed_text of this same prefix: these
    # trial splits of shorter texts must not replace it.
    encode = token_healer(tokenizer)._split if heal else (lambda text: (tokenizer.encode(text), ""))

    def without(dropped: int) -> list[int] | None:  # ids with that many first lines gone, if they fit
        ids = encode("\n".join(lines[dropped:]))[0]
        return ids if len(ids) <= room else None

    def fewest(bad: int, good: int, best: list[int], unit: int) -> tuple[int, list[int]]:
        """Between a count of `unit`s of lines that does not fit and one that does, the fewest
        that fit, searched down from `good` by doubling, then halving: the texts encoded stay
        near the room's size, and fewer lines gone means more tokens, so the answer is exact."""
        step = 1
        while good - step > bad:
            found = without((good - step) * unit)
            if found is None:
                bad = good - step
                break
            good, best, step = good - step, found, step * 2
        while good - bad > 1:
            mid = (good + bad) // 2
            if (found := without(mid * unit)) is None:
                bad = mid
            else:
                good, best = mid, found
        return good, best

    last = len(lines) - 1  # lines that may go: all but the cursor's
    tail = without(last) if last else None
    if tail is None:
        return prefix_ids[len(prefix_ids) - room:]
    most = last // PREFIX_CUT_LINES
    best = without(most * PREFIX_CUT_LINES) if most else None
    if best is None:  # whole steps cannot make it fit: single lines after the last step
        return fewest(most * PREFIX_CUT_LINES, last, tail, 1)[1]
    steps, best = fewest(0, most, best, PREFIX_CUT_LINES)
    if room - len(best) > room // 4:  # a step of long lines: give back what single lines can
        best = fewest((steps - 1) * PREFIX_CUT_LINES, steps * PREFIX_CUT_LINES, best, 1)[1]
    return best


def prompt_budget(context: int, max_tokens: int, max_prompt_tokens: int) -> int:
    """Tokens a completion prompt may take: what the model's context (`max_position_embeddings`,
    the longest row it was trained on) leaves after the reply, within the daemon's own cap."""
    return min(max_prompt_tokens, context - max(max_tokens, 1) - 1)


def fim_prompt_within(tokenizer, prefix: str, suffix: str, order: str, context: int, max_tokens: int,
                      heal: bool = False) -> list[int]:
    """The bare FIM prompt (the whole suffix, then the prefix) with its prefix's start cut where
    needed so that it and `max_tokens` new tokens fit the model's `context`: the eval's and the
    benchmarks' prompts, which must not run the model past what it was trained on."""
    return build_completion_prompt(tokenizer, prefix, suffix, order=order, repo_context=False, heal=heal,
                                   max_prompt_tokens=prompt_budget(context, max_tokens, context),
                                   max_suffix_tokens=context)


def build_completion_prompt(
    tokenizer,
    prefix: str,
    suffix: str,
    chunks: list[ContextChunk] | tuple[ContextChunk, ...] = (),
    path: str | None = None,
    order: str = "psm",
    max_prompt_tokens: int = 2048,
    max_suffix_tokens: int = 256,
    repo_context: bool = True,
    heal: bool = False,
) -> list[int]:
    """With `heal` the end of the prefix is left out (the cursor line's indentation, else its
    last token), to be written again under the constraint
    `forced_text=engine.fim.healed_text(tokenizer, prefix)` (engine.token_healing)."""
    pre, suf, mid = fim_token_ids(tokenizer)
    if not repo_context:
        chunks, path = (), None
    prefix_ids = token_healer(tokenizer).split(prefix)[0] if heal else tokenizer.encode(prefix)
    suffix_ids = tokenizer.encode(suffix)[:max_suffix_tokens]
    header: list[int] = []
    sep = tokenizer.token_id(FILE_SEP)
    if sep is not None and path:
        header = [sep, *tokenizer.encode(f"{path}\n")]
    fixed = 3 + len(header) + len(suffix_ids)
    if fixed + 1 > max_prompt_tokens:  # degenerate budget: drop the suffix before the prefix
        suffix_ids = suffix_ids[: max(0, max_prompt_tokens - 4 - len(header))]
        fixed = 3 + len(header) + len(suffix_ids)
    if len(prefix_ids) > max_prompt_tokens - fixed:
        prefix_ids = _fit_prefix(tokenizer, prefix, prefix_ids, max_prompt_tokens - fixed, heal)
    room = max_prompt_tokens - fixed - len(prefix_ids)
    context: list[int] = []
    if sep is not None:
        for chunk in chunks:
            ids = [sep, *tokenizer.encode(f"{chunk.path}\n{chunk.text.rstrip()}\n")]
            if len(context) + len(ids) > room:
                break
            context += ids
    if order == "spm":
        body = [suf, *suffix_ids, pre, *prefix_ids, mid]
    elif order == "psm":
        body = [pre, *prefix_ids, suf, *suffix_ids, mid]
    else:
        raise ValueError(f"unknown FIM order {order!r}")
    return context + header + body
