"""Timing of the per-keystroke work on a 5,000-line Python file (not a test: run directly).

python tests/lsp/bench_lsp_core.py
"""

import statistics
import time

from wd_lsp.context import build_context
from wd_lsp.document import Position
from wd_lsp.languages import get_parser
from wd_lsp.shape import decide_shape
from wd_lsp.workspace import Workspace


def synthetic_python(n_lines: int) -> str:
    out, i = [], 0
    while sum(s.count("\n") for s in out) < n_lines:
        out.append(
            f"class Model{i}:\n"
            f"    def __init__(self, size: int = {i}) -> None:\n"
            f"        self.size = size\n"
            f"        self.items = [x * {i} for x in range(size)]\n\n"
            f"    def total(self) -> int:\n"
            f"        return sum(self.items) + helper_{i}(self.size)\n\n\n"
            f"def helper_{i}(n):\n"
            f"    '''Scale n.'''\n"
            f"    return n * {i} + 1\n\n\n"
        )
        i += 1
    return "".join(out)


def ms(samples):
    s = sorted(samples)
    return f"p50 {statistics.median(s) * 1e3:.2f} ms, p90 {s[int(len(s) * 0.9)] * 1e3:.2f} ms"


def main():
    text = synthetic_python(5000)
    ws = Workspace(root="/proj")
    doc = ws.open("file:///proj/big.py", text, "python")
    for k in range(5):
        ws.open(f"file:///proj/other{k}.py", synthetic_python(400), "python")
    t0 = time.perf_counter()
    get_parser(doc.language).parse(doc.source_bytes)
    full = time.perf_counter() - t0
    _ = doc.tree  # the first parse
    print(f"{doc.line_count} lines, {doc.byte_size} bytes; full parse {full * 1e3:.1f} ms")

    # Type a new statement, key by key, at the end of a method in the middle of the file.
    line = next(
        i for i in range(doc.line_count // 2, doc.line_count) if "return sum(" in doc.line_text(i)
    )
    end = Position(line, len(doc.line_text(line)))
    ws.change(doc.uri, "\n        ", end, end)
    line, col = line + 1, 8
    edit, reparse, context = [], [], []
    slow = []
    for ch in "value = compute(self.size, [x for x in self.items if x > 2])":
        pos = Position(line, col)
        t0 = time.perf_counter()
        ws.change(doc.uri, ch, pos, pos)
        t1 = time.perf_counter()
        _ = doc.tree  # the reparse
        t2 = time.perf_counter()
        ctx = build_context(
            doc,
            Position(line, col + 1),
            open_documents=ws.documents(),
            recent_edits=ws.recent_edits(),
            root=ws.root,
        )
        decide_shape(ctx)
        t3 = time.perf_counter()
        edit.append(t1 - t0)
        reparse.append(t2 - t1)
        context.append(t3 - t2)
        if t2 - t1 > 0.005:
            slow.append(f"{doc.line_text(line)[8:]!r}: {(t2 - t1) * 1e3:.0f} ms")
        col += 1
    print(f"apply_change: {ms(edit)}")
    print(f"incremental reparse: {ms(reparse)}")
    print(f"context + shape (5 other open files): {ms(context)}")
    print("slow reparses:", "; ".join(slow) or "none")


if __name__ == "__main__":
    main()
