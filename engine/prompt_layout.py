"""Completion prompts laid out so that the prefix cache stays warm while the user types.

Order, most stable first:
  1. extra context chunks (other files: definitions, imports), each `<|file_sep|>path\\ntext`,
  2. then, when the model supports suffix-first FIM (SPM): suffix, then prefix, then the middle
     marker — typing at the cursor only appends to the prompt, so every earlier block stays a
     cache hit; otherwise PSM with the suffix bounded, so a change in the suffix invalidates
     only what follows the prefix.
A token budget is enforced here: the suffix keeps its start, the prefix keeps its end (whole
lines go from its start in steps, so the cut stays put while the user types), the context chunks
go first when space runs out. Text that cannot fit is dropped by its size before it is tokenized,
so a prompt costs what its budget allows, however large the texts sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.fim import FILE_SEP, fim_token_ids
from engine.token_healing import MAX_BACKOFF, token_healer


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

# Texts are measured before they are tokenized: a token covers at most the vocabulary's longest
# token's bytes, so bytes / that is a lower bound on the token count, and a text that cannot fit
# its room is never tokenized (8 MB of text tokenize in seconds, into a GB of memory). A
# normalizer may shrink text first (NFC composes three 3-byte Hangul jamo into one syllable), so
# a tokenizer with one is allowed three times as much.
NORMALIZER_SHRINK = 3
# A long plain prompt is tokenized in pieces of about this many characters, cut at line starts.
PIECE_CHARS = 1 << 16


def max_token_bytes(tokenizer) -> int:
    """Bytes of text that one token can stand for, at most (computed once per tokenizer)."""
    cached = getattr(tokenizer, "_max_token_bytes", None)
    if cached is None:
        backend = tokenizer.backend
        added = [len(t.content.encode()) for t in backend.get_added_tokens_decoder().values()]
        exact = [len(b) for b in token_healer(tokenizer).token_bytes if b]  # byte-level vocabularies
        if not exact:  # another kind: a piece's spelling is at least the text it stands for ("▁" for " ")
            exact = [len(piece.encode()) for piece in backend.get_vocab(with_added_tokens=True)]
        cached = max(exact + added + [1]) * (NORMALIZER_SHRINK if backend.normalizer is not None else 1)
        tokenizer._max_token_bytes = cached
    return cached


def utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def fewest_tokens(text: str | int, per_token: int) -> int:
    """A lower bound on the tokens of `text` (or of that many bytes)."""
    nbytes = text if isinstance(text, int) else utf8_len(text)
    return -(-nbytes // per_token)


def _line_start(text: str, lo: int, hi: int, last: bool) -> int | None:
    """A position in (lo, hi] right after a newline and before a non-space (the last such, or the
    first): byte-level BPE's pre-tokenizers always split there, so text cut there tokenizes as
    it does whole."""
    find = text.rfind if last else text.find
    while lo < hi:
        i = find("\n", lo, hi)
        if i < 0:
            return None
        if i + 1 < len(text) and not text[i + 1].isspace():
            return i + 1
        lo, hi = (lo, i) if last else (i + 1, hi)
    return None


def encode_within(encode, text: str, room: int, per_token: int) -> list[int] | None:
    """`encode(text)`, or None where it has more than `room` tokens; memory stays bounded: a
    text too long by its size alone is not tokenized, a long one goes in pieces cut at line
    starts (mid-line only in a line of over PIECE_CHARS / 2 characters) and stops once over."""
    if fewest_tokens(text, per_token) > room:
        return None
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = len(text) if len(text) - start <= PIECE_CHARS else \
            _line_start(text, start + PIECE_CHARS // 2, start + PIECE_CHARS, last=True) or start + PIECE_CHARS
        ids += encode(text[start:end])
        if len(ids) > room:
            return None
        start = end
    return ids


def plain_prompt_ids(tokenizer, text: str, room: int) -> list[int] | None:
    """A plain prompt's ids (special tokens written in it count), or None where it has more than
    `room` tokens; tokenized in pieces where the tokenizer gives the same ids that way."""
    per_token = max_token_bytes(tokenizer)
    if _splits_at_line_starts(tokenizer):
        return encode_within(tokenizer.encode_prompt, text, room, per_token)
    if fewest_tokens(text, per_token) > room:
        return None
    ids = tokenizer.encode_prompt(text)
    return ids if len(ids) <= room else None


def _splits_at_line_starts(tokenizer) -> bool:
    """Whether text cut at a line start tokenizes as it does whole (not so where each encoding
    starts with a prefix space, as some pre-tokenizers add)."""
    cached = getattr(tokenizer, "_splits_at_line_starts", None)
    if cached is None:
        probe, cut = "a = 1\nb = 2\n", 6
        cached = tokenizer.encode_prompt(probe) == tokenizer.encode_prompt(probe[:cut]) + \
            tokenizer.encode_prompt(probe[cut:])
        tokenizer._splits_at_line_starts = cached
    return cached


def _head_ids(tokenizer, text: str, limit: int, per_token: int) -> list[int]:
    """The first `limit` tokens of `text`, tokenizing only a head long enough to hold them."""
    keep = (limit + 2) * per_token  # characters, so at least as many bytes: over `limit` tokens
    if len(text) > keep:
        text = text[: _line_start(text, keep, 2 * keep, last=False) or keep]
    return tokenizer.encode(text)[:limit]


def _fit_prefix(tokenizer, prefix: str, room: int, heal: bool) -> tuple[list[int], str]:
    """The prefix's ids within `room` tokens, and the text a healed prompt leaves for the model to
    write again: the whole prefix where it fits; else without the fewest whole lines from its
    start that fit, counted in steps of PREFIX_CUT_LINES; where a step would leave over a quarter
    of the room unused (long lines), or no whole step fits, in single lines. A prefix whose
    cursor line alone is too long is cut at an exact token count. Texts that cannot fit by
    their size alone are never tokenized."""
    if room <= 0:
        return [], ""
    healer = token_healer(tokenizer)
    per_token = max_token_bytes(tokenizer)
    lines = prefix.split("\n")  # the last is the cursor's line, kept whole
    after = [0] * (len(lines) + 1)  # after[d]: bytes of the text without its first d lines
    for d in range(len(lines) - 1, -1, -1):
        after[d] = after[d + 1] + utf8_len(lines[d]) + (d < len(lines) - 1)
    # Healing leaves out up to MAX_BACKOFF tokens, or a cursor line of indentation alone.
    slack = MAX_BACKOFF if heal else 0
    spare = utf8_len(lines[-1]) if heal and lines[-1] and not lines[-1].strip() else 0
    # The healer caches its last split for the engine's healed_text of this same prefix: the
    # trial splits of shorter texts must not replace it.
    encode = healer._split if heal else (lambda text: (tokenizer.encode(text), ""))

    def could_fit(dropped: int) -> bool:
        return fewest_tokens(after[dropped] - spare, per_token) <= room + slack

    def without(dropped: int) -> tuple[list[int], str] | None:  # with that many first lines gone, if it fits
        if not could_fit(dropped):
            return None
        found = encode("\n".join(lines[dropped:]))
        return found if len(found[0]) <= room else None

    whole = None
    if could_fit(0):
        whole = healer.split(prefix) if heal else (tokenizer.encode(prefix), "")
        if len(whole[0]) <= room:
            return whole

    def fewest(bad: int, good: int, best, unit: int):
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
        if whole is None:  # enough of the end for more than `room` tokens; its first ones go
            whole = encode(prefix[-(room + slack + 2) * per_token:])
        ids, forced = whole
        return ids[max(0, len(ids) - room):], forced
    most = last // PREFIX_CUT_LINES
    best = without(most * PREFIX_CUT_LINES) if most else None
    if best is None:  # whole steps cannot make it fit: single lines after the last step
        return fewest(most * PREFIX_CUT_LINES, last, tail, 1)[1]
    steps, best = fewest(0, most, best, PREFIX_CUT_LINES)
    if room - len(best[0]) > room // 4:  # a step of long lines: give back what single lines can
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
    `forced_text=engine.fim.healed_text(tokenizer, prefix)` (engine.token_healing), or the text
    `layout_completion_prompt` gives with the same ids."""
    return layout_completion_prompt(tokenizer, prefix, suffix, chunks, path, order, max_prompt_tokens,
                                    max_suffix_tokens, repo_context, heal)[0]


def layout_completion_prompt(
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
) -> tuple[list[int], str]:
    """The completion prompt's ids, and with `heal` the text the first new tokens must write
    (the request's forced_text); its cost is bounded by the budget, not by the texts' sizes."""
    if order not in ("spm", "psm"):
        raise ValueError(f"unknown FIM order {order!r}")
    pre, suf, mid = fim_token_ids(tokenizer)
    if not repo_context:
        chunks, path = (), None
    per_token = max_token_bytes(tokenizer)
    suffix_ids = _head_ids(tokenizer, suffix, max_suffix_tokens, per_token)
    header: list[int] = []
    sep = tokenizer.token_id(FILE_SEP)
    if sep is not None and path:
        header = [sep, *tokenizer.encode(f"{path}\n")]
    fixed = 3 + len(header) + len(suffix_ids)
    if fixed + 1 > max_prompt_tokens:  # degenerate budget: drop the suffix before the prefix
        suffix_ids = suffix_ids[: max(0, max_prompt_tokens - 4 - len(header))]
        fixed = 3 + len(header) + len(suffix_ids)
    prefix_ids, forced = _fit_prefix(tokenizer, prefix, max_prompt_tokens - fixed, heal)
    room = max_prompt_tokens - fixed - len(prefix_ids)
    context: list[int] = []
    if sep is not None:
        for chunk in chunks:
            text = f"{chunk.path}\n{chunk.text.rstrip()}\n"
            if 1 + fewest_tokens(text, per_token) > room - len(context):
                break  # too long by its size alone
            ids = [sep, *tokenizer.encode(text)]
            if len(context) + len(ids) > room:
                break
            context += ids
    if order == "spm":
        body = [suf, *suffix_ids, pre, *prefix_ids, mid]
    else:
        body = [pre, *prefix_ids, suf, *suffix_ids, mid]
    return context + header + body, forced
