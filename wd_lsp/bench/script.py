"""What the simulated user types: a few consecutive lines of a real file, key by key.

The document is opened as the file with those lines taken out, the cursor where they were; the
lines are then typed back in. Enter carries the next line's indentation in the same keystroke (as
an editor's auto-indent does), and the typist pauses after each Enter, where a person would
look at the screen and where multi-line suggestions matter.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Cadence:
    key_ms: float = 110.0  # mean time between keys (~90 words a minute)
    jitter: float = 0.35  # each gap is key_ms * uniform(1 - jitter, 1 + jitter)
    line_pause_ms: float = 700.0  # after each Enter (and after the last key)
    word_pause_ms: float = 0.0  # after each space that ends a word (a typist who stops to look)


@dataclass(frozen=True)
class Key:
    text: str  # inserted at the cursor
    delay_ms: float  # wait before pressing it


@dataclass(frozen=True)
class Segment:
    name: str  # file name shown in the document URI
    before: str  # text above the cursor when the document opens
    typed: str  # what the user types, in order
    after: str  # text below the cursor (stays put)

    def truth_after(self, typed_so_far: int) -> str:
        """What the user will type next (and what then follows) after `typed_so_far` chars."""
        return self.typed[typed_so_far:] + self.after


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def pick_segment(
    name: str, text: str, lines: int, rng: random.Random, min_before: int = 0, min_after: int = 0
) -> Segment | None:
    """`lines` consecutive lines starting at a random code line (not blank, not a comment) with
    at least `min_before` chars above and `min_after` below, or None when there is none."""
    all_lines = text.split("\n")
    offsets = [0]
    for line in all_lines:
        offsets.append(offsets[-1] + len(line) + 1)
    candidates = [
        i
        for i in range(8, len(all_lines) - lines - 1)
        if offsets[i] >= min_before
        and len(text) - offsets[i + lines] >= min_after
        and all_lines[i].strip()
        and not all_lines[i].lstrip().startswith(("#", "//", '"""', "'''"))
        and sum(len(x.strip()) for x in all_lines[i : i + lines]) >= 12 * lines
        and max(len(x) for x in all_lines[i : i + lines]) <= 120
    ]
    if not candidates:
        return None
    start = rng.choice(candidates)
    before = "\n".join(all_lines[:start]) + "\n"
    typed = "\n".join(all_lines[start : start + lines]) + "\n"
    after = "\n".join(all_lines[start + lines :])
    return Segment(name, before, typed, after)


def keystrokes(segment: Segment, cadence: Cadence, rng: random.Random) -> list[Key]:
    """The segment's text as keys: indentation and Enter+indentation are single keys."""

    def gap() -> float:
        return cadence.key_ms * rng.uniform(1 - cadence.jitter, 1 + cadence.jitter)

    keys: list[Key] = []
    lines = segment.typed.split("\n")[:-1]  # typed ends with "\n"
    for n, line in enumerate(lines):
        indent = _indent(line)
        if n == 0 and indent:
            keys.append(Key(indent, gap()))
        body = line[len(indent) :]
        for i, ch in enumerate(body):
            keys.append(Key(ch, gap()))
            if ch == " " and cadence.word_pause_ms and body[i - 1 : i] != " " and i + 1 < len(body):
                keys.append(Key("", cadence.word_pause_ms))
        next_indent = _indent(lines[n + 1]) if n + 1 < len(lines) else ""
        keys.append(Key("\n" + next_indent, gap()))
        if n + 1 < len(lines):
            keys.append(Key("", cadence.line_pause_ms))  # a pause, no key: marks the wait
    keys.append(Key("", cadence.line_pause_ms))
    return _merge_pauses(keys)


def _merge_pauses(keys: list[Key]) -> list[Key]:
    """Fold each pause into the next key's delay; a trailing pause stays as an empty key."""
    out: list[Key] = []
    carry = 0.0
    for key in keys:
        if key.text == "" and key is not keys[-1]:
            carry += key.delay_ms
            continue
        out.append(Key(key.text, key.delay_ms + carry))
        carry = 0.0
    return out


def utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2
