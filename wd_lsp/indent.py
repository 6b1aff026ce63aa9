"""Indentation style of a text: tabs or N spaces, and column arithmetic on leading whitespace."""

from __future__ import annotations

from collections import Counter

TAB_WIDTH = 4
_SAMPLE_LINES = 2000


def leading_ws(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def columns(ws: str, tab_width: int = TAB_WIDTH) -> int:
    """Visual width of leading whitespace."""
    col = 0
    for c in ws:
        col = (col // tab_width + 1) * tab_width if c == "\t" else col + 1
    return col


def detect_indent_unit(text: str, default: str = "    ") -> str:
    """The document's indent unit: "\\t" or a run of spaces, from how its lines step in."""
    tabs = spaces = 0
    steps: Counter[int] = Counter()
    prev = 0
    for line in text.splitlines()[:_SAMPLE_LINES]:
        if not line.strip():
            continue
        ws = leading_ws(line)
        if ws.startswith("\t"):
            tabs += 1
        elif ws:
            spaces += 1
        width = len(ws) if not ws.startswith("\t") else prev
        if not ws.startswith("\t") and width > prev:
            steps[width - prev] += 1
        prev = width
    if tabs > spaces:
        return "\t"
    if not steps:
        return default
    # Ties between e.g. 2 and 4 favour the smaller: 4 is also two steps of 2.
    best = max(steps.items(), key=lambda kv: (kv[1], -kv[0]))[0]
    return " " * best if 1 < best <= 8 else default


def retab(line_ws: str, unit: str, tab_width: int = TAB_WIDTH) -> str:
    """Re-express leading whitespace in the document's style (tabs <-> spaces)."""
    if unit == "\t":
        col = columns(line_ws, tab_width)
        return "\t" * (col // tab_width) + " " * (col % tab_width)
    return " " * columns(line_ws, len(unit) if unit else tab_width)
