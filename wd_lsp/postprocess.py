"""Filters applied to the engine's text before it is shown as ghost text.

Each filter takes the text and returns a (possibly shorter) text; `postprocess` chains them
and returns None when nothing worth showing is left.
"""

from __future__ import annotations

import re

from .context import CompletionContext
from .indent import columns, detect_indent_unit, leading_ws, retab
from .shape import StopRules, apply_stop_rules

OPENERS = {"(": ")", "[": "]", "{": "}"}
CLOSERS = {v: k for k, v in OPENERS.items()}
QUOTES = "\"'`"
# How far back the prefix is scanned for brackets still open at the cursor.
CONTEXT_LINES = 50
_TRIVIAL = re.compile(r"^[\s)\]};,:]*$")


def postprocess(completion: str, ctx: CompletionContext, rules: StopRules) -> str | None:
    text, _ = apply_stop_rules(completion, rules)
    if not rules.multiline:
        text = text.split("\n", 1)[0]
    if "\n" in text or not ctx.line_suffix.strip():
        # trailing blanks are noise at a line's end or after a block; mid-line they may matter
        text = text.rstrip()
    if not text.strip():
        return None
    text = trim_suffix_overlap(text, ctx.line_prefix, ctx.line_suffix, ctx.language)
    text = drop_lines_in_suffix(text, ctx.suffix)
    text = balance_brackets(text, ctx.prefix, ctx.line_suffix, ctx.language)
    text = cut_repetition(text)
    if repeats_neighbour(text, ctx.prefix, ctx.suffix):
        return None
    text = normalize_indentation(text, ctx.indent_unit)
    if not text.strip():
        return None
    return text


# ---- a small bracket/quote scanner ----------------------------------------------------


def _line_comment(language: str) -> str:
    return "#" if language in ("python", "plaintext") else "//"


def scan_brackets(text: str, language: str = "plaintext"):
    """Yield (index, char) of brackets outside strings and line comments.

    A quote opens a string only if it closes on the same line (so Rust lifetimes and
    apostrophes in prose stay harmless); an unclosed one is yielded as (index, quote).
    """
    comment = _line_comment(language)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith(comment, i):
            nl = text.find("\n", i)
            i = n if nl == -1 else nl
            continue
        if c in QUOTES:
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            if j < n and text[j] == c:
                i = j + 1
                continue
            yield i, c
        elif c in OPENERS or c in CLOSERS:
            yield i, c
        i += 1


def imbalance(text: str, language: str = "plaintext") -> int:
    """Unmatched closers + unclosed openers + unclosed quotes."""
    stack: list[str] = []
    bad = 0
    for _, c in scan_brackets(text, language):
        if c in OPENERS:
            stack.append(c)
        elif c in CLOSERS:
            if stack and stack[-1] == CLOSERS[c]:
                stack.pop()
            else:
                bad += 1
        else:
            bad += 1
    return bad + len(stack)


def open_brackets(text: str, language: str = "plaintext") -> list[str]:
    """Openers still open at the end of `text` (innermost last)."""
    stack: list[str] = []
    for _, c in scan_brackets(text, language):
        if c in OPENERS:
            stack.append(c)
        elif c in CLOSERS and stack and stack[-1] == CLOSERS[c]:
            stack.pop()
    return stack


# ---- filters ---------------------------------------------------------------------------


def trim_suffix_overlap(
    text: str, line_prefix: str, line_suffix: str, language: str = "plaintext"
) -> str:
    """Drop the end of `text` that repeats the start of the line's suffix.

    Editors auto-close brackets and quotes, so the suffix often starts with `)` or `"` that
    the model also writes. The overlap is removed only if that makes the cursor line better
    balanced: `print(|)` + `foo()` stays, `print(|)` + `"hi")` becomes `"hi"`.
    """
    rest = line_suffix.lstrip(" \t")
    if not rest:
        return text
    best, best_score = text, imbalance(line_prefix + text + line_suffix, language)
    for k in range(min(len(rest), len(text)), 0, -1):
        if not text.endswith(rest[:k]):
            continue
        cut = text[:-k]
        score = imbalance(line_prefix + cut + line_suffix, language)
        if score < best_score:
            best, best_score = cut, score
    return best


def drop_lines_in_suffix(text: str, suffix: str) -> str:
    """Remove a block's trailing lines that the suffix already has (e.g. its closing `}`).

    Lines compare with their indentation, so an inner `}` never matches an outer one.
    """
    lines = text.split("\n")
    following = [l.rstrip() for l in suffix.split("\n")[1:] if l.strip()]
    body = [i for i in range(1, len(lines)) if lines[i].strip()]
    for m in range(min(len(body), len(following)), 0, -1):
        if [lines[i].rstrip() for i in body[-m:]] == following[:m]:
            return "\n".join(lines[: body[-m]]).rstrip()
    return text


def balance_brackets(text: str, prefix: str, line_suffix: str, language: str = "plaintext") -> str:
    """Cut `text` at the first closer that matches nothing open at the cursor.

    Brackets open in the prefix may be closed by the completion, except those the line's
    suffix already closes (auto-closed pairs).
    """
    context = open_brackets("\n".join(prefix.split("\n")[-CONTEXT_LINES:]), language)
    # What the rest of the line closes is not ours to close: `len(|f.read())` closes `len(`.
    suffix_own: list[str] = []
    for _, c in scan_brackets(line_suffix.split("\n")[0], language):
        if c in OPENERS:
            suffix_own.append(c)
        elif c in CLOSERS:
            if suffix_own and suffix_own[-1] == CLOSERS[c]:
                suffix_own.pop()
            elif context and context[-1] == CLOSERS[c]:
                context.pop()
            else:
                break
    own: list[str] = []
    for i, c in scan_brackets(text, language):
        if c in OPENERS:
            own.append(c)
        elif c in CLOSERS:
            if own:
                if own[-1] != CLOSERS[c]:
                    return text[:i].rstrip()
                own.pop()
            elif context and context[-1] == CLOSERS[c]:
                context.pop()
            else:
                return text[:i].rstrip()
    return text


def cut_repetition(text: str, max_period: int = 4, repeats: int = 3) -> str:
    """Keep one copy of a line or block the model repeats `repeats` times in a row."""
    raw = text.split("\n")
    lines = [l.strip() for l in raw]  # the first line has no indentation of its own
    for i in range(len(lines)):
        for period in range(1, max_period + 1):
            block = lines[i : i + period]
            if len(block) < period or all(_TRIVIAL.match(l) for l in block):
                continue
            if all(
                lines[i + r * period : i + (r + 1) * period] == block for r in range(1, repeats)
            ):
                return "\n".join(raw[: i + period])
    return text


def repeats_neighbour(text: str, prefix: str, suffix: str) -> bool:
    """The suggestion only repeats the code line just above or just below the cursor."""
    s = text.strip()
    if not s or _TRIVIAL.match(s):
        return not s
    above = [l.strip() for l in prefix.split("\n")[:-1] if l.strip()]
    below = [l.strip() for l in suffix.split("\n")[1:] if l.strip()]
    first = s.split("\n")[0].strip()
    if "\n" not in s and len(s) >= 4 and above and s == above[-1]:
        return True
    return bool(below) and first == below[0] and s.count("\n") <= 0


def normalize_indentation(text: str, unit: str) -> str:
    """Re-indent lines after the first in the document's style (tabs vs spaces)."""
    lines = text.split("\n")
    if len(lines) < 2:
        return text
    body = lines[1:]
    uses_tabs = any(l.startswith("\t") for l in body)
    uses_spaces = any(l.startswith(" ") for l in body)
    if unit == "\t" and uses_spaces:
        model_unit = detect_indent_unit("\n".join(body))
        return "\n".join([lines[0]] + [_reindent(l, "\t", len(model_unit)) for l in body])
    if unit != "\t" and uses_tabs:
        return "\n".join([lines[0]] + [_reindent(l, unit, 1) for l in body])
    return text


def _reindent(line: str, unit: str, tab_width: int) -> str:
    ws = leading_ws(line)
    if not ws:
        return line
    if unit == "\t":
        level, extra = divmod(columns(ws, tab_width), tab_width)
        return "\t" * level + " " * extra + line[len(ws) :]
    return retab(ws, unit) + line[len(ws) :]  # one tab is one indent level
