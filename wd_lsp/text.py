"""Line tables and UTF-16 arithmetic for LSP positions.

LSP counts `character` in UTF-16 code units and accepts "\\n", "\\r\\n" and "\\r" as line ends.
Python strings index code points, so a character beyond U+FFFF is one index but two units.
"""

from __future__ import annotations

import re
from bisect import bisect_right

EOL = re.compile(r"\r\n|\r|\n")


def utf16_len(s: str) -> int:
    """Number of UTF-16 code units in `s`."""
    if s.isascii():
        return len(s)
    return len(s) + sum(1 for c in s if ord(c) > 0xFFFF)


def utf16_to_index(line: str, units: int) -> tuple[int, bool]:
    """Code point index in `line` for a UTF-16 column; (index, exact).

    A column past the end clamps to the end; one in the middle of a surrogate pair rounds
    down to the start of that character. Both come back with exact=False.
    """
    if units < 0:
        return 0, False
    if line.isascii():
        if units > len(line):
            return len(line), False
        return units, True
    seen = 0
    for i, c in enumerate(line):
        if seen == units:
            return i, True
        width = 2 if ord(c) > 0xFFFF else 1
        if seen + width > units:
            return i, False
        seen += width
    return len(line), seen == units


def line_starts(text: str) -> list[int]:
    """Code point offsets where each line begins; always at least [0]."""
    return [0] + [m.end() for m in EOL.finditer(text)]


def update_line_starts(
    starts: list[int], new_text: str, start: int, old_end: int, new_len: int
) -> list[int]:
    """Line starts after replacing old text[start:old_end] with `new_len` code points.

    Only the lines around the edit are rescanned: the line before it too, because an
    inserted "\\n" right after a "\\r" merges two line ends into one.
    """
    delta = new_len - (old_end - start)
    first = max(0, bisect_right(starts, start) - 2)
    last = bisect_right(starts, old_end)  # index of the first line start after the edit's line
    # keep one more line so a "\r" at the edit's end that gains a following "\n" is seen
    last = min(last + 1, len(starts))
    scan_from = starts[first]
    tail = [s + delta for s in starts[last:]]
    scan_to = tail[0] if tail else len(new_text)
    middle = [m.end() for m in EOL.finditer(new_text, scan_from, scan_to)]
    if tail and middle and middle[-1] == tail[0]:
        middle.pop()
    return starts[: first + 1] + middle + tail


def line_of(starts: list[int], offset: int) -> int:
    """Index of the line that contains code point `offset`."""
    return bisect_right(starts, offset) - 1
