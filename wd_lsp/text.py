"""Line tables and position-unit arithmetic for LSP positions.

LSP accepts "\\n", "\\r\\n" and "\\r" as line ends (nothing else: form feed, U+0085 and U+2028 are
ordinary characters) and counts `character` in the position encoding negotiated at initialize:
UTF-8 bytes, UTF-16 code units (the default) or UTF-32 code points. Python strings index code
points, so a character beyond U+FFFF is one index but two UTF-16 units and four UTF-8 bytes.

A lone surrogate (legal in JSON: "\\ud800") is kept as one code point: one UTF-16 unit, as the
client counts it, one UTF-32 unit, and three UTF-8 bytes (its WTF-8 form, also the length of
the U+FFFD a UTF-8 client would hold in its place).
"""

from __future__ import annotations

import re
from bisect import bisect_right

EOL = re.compile(r"\r\n|\r|\n")

UTF8, UTF16, UTF32 = "utf-8", "utf-16", "utf-32"
ENCODINGS = (UTF8, UTF16, UTF32)


def encode_utf8(text: str) -> bytes:
    # surrogatepass: a lone surrogate (legal in JSON) must not make us crash.
    return text.encode("utf-8", "surrogatepass")


def utf16_len(s: str) -> int:
    """Number of UTF-16 code units in `s`."""
    if s.isascii():
        return len(s)
    return len(s) + sum(1 for c in s if ord(c) > 0xFFFF)


def units_len(s: str, encoding: str) -> int:
    """Length of `s` in the units of a position encoding."""
    if s.isascii() or encoding == UTF32:
        return len(s)
    if encoding == UTF16:
        return utf16_len(s)
    return len(encode_utf8(s))


def units_to_index(line: str, units: int, encoding: str) -> tuple[int, bool]:
    """Code point index in `line` for a column in `encoding`'s units; (index, exact).

    A column past the end clamps to the end; one inside a character (between the halves of a
    surrogate pair, inside a UTF-8 sequence) rounds down to that character's start. Both come
    back with exact=False.
    """
    if units < 0:
        return 0, False
    if line.isascii() or encoding == UTF32:
        if units > len(line):
            return len(line), False
        return units, True
    if encoding == UTF16:
        return utf16_to_index(line, units)
    return utf8_to_index(line, units)


def utf16_to_index(line: str, units: int) -> tuple[int, bool]:
    seen = 0
    for i, c in enumerate(line):
        if seen == units:
            return i, True
        width = 2 if ord(c) > 0xFFFF else 1
        if seen + width > units:
            return i, False
        seen += width
    return len(line), seen == units


def utf8_to_index(line: str, units: int) -> tuple[int, bool]:
    data = encode_utf8(line)
    if units >= len(data):
        return len(line), units == len(data)
    start = units
    while data[start] & 0xC0 == 0x80:  # a continuation byte: back to its character's lead byte
        start -= 1
    return len(data[:start].decode("utf-8", "surrogatepass")), start == units


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
