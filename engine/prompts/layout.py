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

from engine.decoding.token_healing import MAX_BACKOFF, token_healer
from engine.prompts.fim import FILE_SEP, ORDERS, fim_layout, fim_token_ids


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
            return tuple(o for o in orders if o in ORDERS) or ("psm",)
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
# its room is never tokenized (tokenizing costs time and memory in proportion to the text's
# size, however large a client sends it). An NFC or NFD normalizer may shrink text first (NFC
# composes three 3-byte Hangul jamo into one syllable), so a tokenizer with one is allowed three
# times as much.
NORMALIZER_SHRINK = 3
# A tokenizer that can shrink text without a known bound (`max_token_bytes` None: an added token
# that takes in whitespace, a normalizer such as NFKC or Strip) cannot refuse a text by its size:
# a text is tokenized whole up to this many bytes instead (a plain prompt longer is refused, a
# prefix or suffix cut to it), which bounds the memory tokenizing takes and is far more than a
# prompt of a 32K context holds of code.
UNBOUNDED_TEXT_BYTES = 512 << 10
# A long plain prompt is tokenized in pieces of about this many characters, cut at line starts.
PIECE_CHARS = 1 << 16


def max_token_bytes(tokenizer) -> int | None:
    """Bytes of text that one token can stand for, at most; None where the tokenizer can shrink
    text without a known bound (computed once per tokenizer)."""
    if not hasattr(tokenizer, "_max_token_bytes"):
        tokenizer._max_token_bytes = _max_token_bytes(tokenizer)
    return tokenizer._max_token_bytes


def _max_token_bytes(tokenizer) -> int | None:
    backend = tokenizer.backend
    added = list(backend.get_added_tokens_decoder().values())
    if any(t.lstrip or t.rstrip for t in added):
        return None  # such a token takes in the whitespace beside it, however much there is
    shrink = _shrink_bound(backend)
    if shrink is None:
        return None
    healer = token_healer(tokenizer)
    if healer.token_bytes:  # a byte-level vocabulary: each token's exact bytes
        if not healer.supported:
            return None  # a byte without a token of its own is dropped from the text
        exact = [len(b) for b in healer.token_bytes if b]
    elif getattr(backend.model, "byte_fallback", False):
        # Another kind: a piece's spelling is at least the text it stands for ("▁" for " "), and
        # a character outside the vocabulary becomes byte tokens, never nothing or one <unk>.
        exact = [len(piece.encode()) for piece in backend.get_vocab(with_added_tokens=True)]
    else:
        return None  # unknown characters may vanish, or a run of them become one <unk>
    return max(exact + [len(t.content.encode()) for t in added] + [1]) * shrink


def _shrink_bound(backend) -> int | None:
    """How many times fewer bytes the normalizer and pre-tokenizer may leave of a text (1: never
    fewer), or None where they may drop text without bound."""
    try:
        normalizer = _state(backend.normalizer)
        pre_tokenizer = _state(backend.pre_tokenizer)
    except (AttributeError, TypeError, ValueError):  # a component that does not describe itself
        return None
    return _normalizer_shrink(normalizer) if _keeps_every_character(pre_tokenizer) else None


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_shrink(spec: dict | None) -> int | None:
    """Only normalizers known not to shrink text, or NFC/NFD (by at most NORMALIZER_SHRINK), keep
    a bound; others may shrink it without one (Strip, StripAccents, a Replace by shorter text, a
    precompiled charsmap, NFKC which turns 4-byte letters into 1-byte ones, Lowercase, ...)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind in ("NFC", "NFD"):
        return NORMALIZER_SHRINK
    if kind == "Prepend":
        return 1
    if kind == "Replace":
        pattern = spec.get("pattern") or {}
        plain = isinstance(pattern.get("String"), str) and isinstance(spec.get("content"), str)
        return 1 if plain and utf8_len(spec["content"]) >= utf8_len(pattern["String"]) else None
    if kind == "Sequence":
        total = 1
        for member in spec.get("normalizers") or []:
            factor = _normalizer_shrink(member)
            if factor is None:
                return None
            total *= factor
        return total
    return None


def _keeps_every_character(spec: dict | None) -> bool:
    """Whether the pre-tokenizer only splits text (Whitespace, WhitespaceSplit, BertPreTokenizer,
    CharDelimiterSplit and a "Removed" behavior drop characters)."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_every_character(member) for member in spec.get("pretokenizers") or [])
    if kind in ("Split", "Punctuation"):
        return spec.get("behavior") != "Removed"
    return kind in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts")


def utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def most_bytes(tokens: int, per_token: int | None) -> int:
    """The most UTF-8 bytes a text of at most `tokens` tokens can have (`per_token` from
    max_token_bytes); UNBOUNDED_TEXT_BYTES where no bound is known."""
    if tokens <= 0:
        return tokens
    return tokens * per_token if per_token is not None else UNBOUNDED_TEXT_BYTES


def may_fit(text: str | int, room: int, per_token: int | None) -> bool:
    """False where `text` (or that many bytes) has more than `room` tokens by its size alone."""
    nbytes = text if isinstance(text, int) else utf8_len(text)
    return nbytes <= most_bytes(room, per_token)


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


def encode_within(encode, text: str, room: int, per_token: int | None) -> list[int] | None:
    """`encode(text)`, or None where it has more than `room` tokens; memory stays bounded: a
    text too long by its size alone is not tokenized, a long one goes in pieces cut at line
    starts and stops once over. A line is never cut (a cut inside one can change its ids): a
    line longer than a piece makes a longer piece, as long as the size check lets it be."""
    if not may_fit(text, room, per_token):
        return None
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = _piece_end(text, start)
        ids += encode(text[start:end])
        if len(ids) > room:
            return None
        start = end
    return ids


def _piece_end(text: str, start: int) -> int:
    """The end of the piece from `start`: the rest where it is short, else the last line start in
    the second half of PIECE_CHARS, else the first one past it, else the end."""
    if len(text) - start <= PIECE_CHARS:
        return len(text)
    return (
        _line_start(text, start + PIECE_CHARS // 2, start + PIECE_CHARS, last=True)
        or _line_start(text, start + PIECE_CHARS, len(text), last=False)
        or len(text)
    )


def plain_prompt_ids(tokenizer, text: str, room: int) -> list[int] | None:
    """A plain prompt's ids (special tokens written in it count), or None where it has more than
    `room` tokens (or, for a tokenizer without a size bound, more than UNBOUNDED_TEXT_BYTES
    bytes); tokenized in pieces where the tokenizer gives the same ids that way."""
    per_token = max_token_bytes(tokenizer)
    if per_token is not None and _splits_at_line_starts(tokenizer):
        return encode_within(tokenizer.encode_prompt, text, room, per_token)
    if not may_fit(text, room, per_token):
        return None
    ids = tokenizer.encode_prompt(text)
    return ids if len(ids) <= room else None


def _splits_at_line_starts(tokenizer) -> bool:
    """Whether text cut at a line start tokenizes as it does whole (not so where each encoding
    starts with a prefix space, as some pre-tokenizers add)."""
    cached = getattr(tokenizer, "_splits_at_line_starts", None)
    if cached is None:
        probe, cut = "a = 1\nb = 2\n", 6
        cached = tokenizer.encode_prompt(probe) == tokenizer.encode_prompt(
            probe[:cut]
        ) + tokenizer.encode_prompt(probe[cut:])
        tokenizer._splits_at_line_starts = cached
    return cached


def _head_ids(tokenizer, text: str, limit: int, per_token: int | None) -> list[int]:
    """The first `limit` tokens of `text`, tokenizing only a head long enough to hold them."""
    keep = most_bytes(
        limit + 2, per_token
    )  # characters, so at least as many bytes: over `limit` tokens
    if len(text) > keep:
        text = text[: _line_start(text, keep, 2 * keep, last=False) or keep]
    return tokenizer.encode(text)[:limit]


def _lines_out_of_reach(prefix: str, keep: int) -> tuple[int, int]:
    """How many of the prefix's first lines start more than `keep` characters before its end, and
    where the first other line starts (the cursor line's start where every line does). Counted,
    not split: the cost stays with `keep`, however many lines there are."""
    cut = len(prefix) - keep
    if cut <= 0:
        return 0, 0
    newline = prefix.find("\n", cut - 1)  # the first line start at or after `cut` follows it
    start = newline + 1 if newline >= 0 else prefix.rfind("\n") + 1
    return prefix.count("\n", 0, start), start


def _fit_prefix(tokenizer, prefix: str, room: int, heal: bool) -> tuple[list[int], str]:
    """The prefix's ids within `room` tokens, and the text a healed prompt leaves for the model to
    write again: the whole prefix where it fits; else without the fewest whole lines from its
    start that fit, counted in steps of PREFIX_CUT_LINES; where a step would leave over a quarter
    of the room unused (long lines), or no whole step fits, in single lines. A prefix whose
    cursor line alone is too long is cut at an exact token count. Texts that cannot fit by
    their size alone are never tokenized, nor split into lines."""
    if room <= 0:
        return [], ""
    healer = token_healer(tokenizer)
    per_token = max_token_bytes(tokenizer)
    cursor_line = prefix[prefix.rfind("\n") + 1 :]  # kept whole
    # Healing leaves out up to MAX_BACKOFF tokens, or a cursor line of indentation alone.
    slack = MAX_BACKOFF if heal else 0
    spare = utf8_len(cursor_line) if heal and cursor_line and not cursor_line.strip() else 0
    most = most_bytes(room + slack, per_token)
    # The lines that start too far back go by their size (a character is at least a byte); they
    # are counted, so the cut steps below keep their places in the file while the user types.
    gone, start = _lines_out_of_reach(prefix, most + spare)
    lines = prefix[start:].split("\n")
    after = [0] * (len(lines) + 1)  # after[k]: bytes of the text without its first gone + k lines
    for k in range(len(lines) - 1, -1, -1):
        after[k] = after[k + 1] + utf8_len(lines[k]) + (k < len(lines) - 1)
    # The healer caches its last split for the engine's healed_text of this same prefix: the
    # trial splits of shorter texts must not replace it.
    encode = healer._split if heal else (lambda text: (tokenizer.encode(text), ""))

    def could_fit(dropped: int) -> bool:
        return dropped >= gone and after[dropped - gone] - spare <= most

    def without(
        dropped: int,
    ) -> tuple[list[int], str] | None:  # with that many first lines gone, if it fits
        if not could_fit(dropped):
            return None
        found = encode("\n".join(lines[dropped - gone :]))
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

    last = gone + len(lines) - 1  # lines that may go: all but the cursor's
    tail = without(last) if last else None
    if tail is None:
        if whole is None:  # enough of the end for more than `room` tokens; its first ones go
            whole = encode(prefix[-most_bytes(room + slack + 2, per_token) :])
        ids, forced = whole
        return ids[max(0, len(ids) - room) :], forced
    steps = last // PREFIX_CUT_LINES
    best = without(steps * PREFIX_CUT_LINES) if steps else None
    if best is None:  # whole steps cannot make it fit: single lines after the last step
        return fewest(steps * PREFIX_CUT_LINES, last, tail, 1)[1]
    steps, best = fewest(0, steps, best, PREFIX_CUT_LINES)
    if room - len(best[0]) > room // 4:  # a step of long lines: give back what single lines can
        best = fewest((steps - 1) * PREFIX_CUT_LINES, steps * PREFIX_CUT_LINES, best, 1)[1]
    return best


# A completion prompt's cap (the daemon's default), below the model's context when that is larger.
MAX_PROMPT_TOKENS = 4096


def prompt_budget(context: int, max_tokens: int, max_prompt_tokens: int) -> int:
    """Tokens a completion prompt may take: what the model's context (`max_position_embeddings`,
    the longest row it was trained on) leaves after the reply, within the daemon's own cap."""
    return min(max_prompt_tokens, context - max(max_tokens, 1) - 1)


def fim_prompt_within(
    tokenizer,
    prefix: str,
    suffix: str,
    order: str,
    context: int,
    max_tokens: int,
    heal: bool = False,
) -> list[int]:
    """The bare FIM prompt (the whole suffix, then the prefix) with its prefix's start cut where
    needed so that it and `max_tokens` new tokens fit the model's `context`: the eval's and the
    benchmarks' prompts, which must not run the model past what it was trained on."""
    return build_completion_prompt(
        tokenizer,
        prefix,
        suffix,
        order=order,
        repo_context=False,
        heal=heal,
        max_prompt_tokens=prompt_budget(context, max_tokens, context),
        max_suffix_tokens=context,
    )


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
    last token), to be written again under the constraint `forced_text=` the text
    `layout_completion_prompt` gives with the same ids (engine.decoding.token_healing). That text
    is `engine.prompts.fim.healed_text(tokenizer, prefix)` wherever the prompt keeps the prefix
    from a line start (all of it, or its last lines); where not even the cursor line fits, it is
    the healed text of the end that was tokenized, and where the budget leaves the prefix no room
    at all it is "" (nothing of the prefix is in the prompt, so nothing is written again)."""
    return layout_completion_prompt(
        tokenizer,
        prefix,
        suffix,
        chunks,
        path,
        order,
        max_prompt_tokens,
        max_suffix_tokens,
        repo_context,
        heal,
    )[0]


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
    if order not in ORDERS:
        raise ValueError(f"unknown FIM order {order!r}")
    markers = fim_token_ids(tokenizer)
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
            if not may_fit(text, room - len(context) - 1, per_token):
                break  # too long by its size alone
            ids = [sep, *tokenizer.encode(text)]
            if len(context) + len(ids) > room:
                break
            context += ids
    return context + header + fim_layout(markers, prefix_ids, suffix_ids, order), forced
