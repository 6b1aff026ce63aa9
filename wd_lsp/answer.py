"""The shape of an inline completion answer, and the completion item an editor has selected.

Every item replaces the cursor line's head: its range runs from the start of the line to the
cursor, and its text is that head plus the suggestion. An item anchored at the line start stays
valid while the user edits the line (Neovim 0.12 redraws a zero-width item at a column that may
no longer exist), and it is what other completion servers send.

With LSP 3.18's `selectedCompletionInfo` (VS Code while its suggest widget is open), the
suggestion continues the line as if the selected item's text had replaced its range: the item
covers the line from its start to the end of that range (or to the cursor, if later), and its
text starts with the line's head with the selected text applied, so that one Tab takes both. A
selected item that does not fit the cursor's line (another line, a range that ends before it
starts or starts after the cursor, a line break in its text) is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .context import CompletionContext, encodable
from .document import Document
from .indent import leading_ws


@dataclass(frozen=True)
class Selected:
    """A selected completion item applied to the cursor's line (code point offsets)."""

    start: int  # where the item's range starts
    end: int  # the end of what the answer replaces: the range's end or the cursor, if later
    applied: str  # what stands in [start, end) once the item is applied
    head: str  # the line from its start to `end`, with the item applied

    @property
    def replaced(self) -> int:
        """Code points of the document in [start, end)."""
        return self.end - self.start


def select_item(doc: Document, cursor: int, info) -> Selected | None:
    """`info` (an `lsprotocol` SelectedCompletionInfo, or anything with `.range` and `.text`)
    applied at `cursor` (a code point offset), or None where it does not fit the cursor's line."""
    if info is None:
        return None
    rng, text = getattr(info, "range", None), getattr(info, "text", None)
    if rng is None or not isinstance(text, str) or "\n" in text or "\r" in text:
        return None
    line = doc.line_at(cursor)
    if not rng.start.line == rng.end.line == line:
        return None
    start, end = _exact_offset(doc, rng.start), _exact_offset(doc, rng.end)
    if start is None or end is None or not start <= end or start > cursor:
        return None
    applied = text + doc.text[end:cursor]  # the cursor may lie past the range
    return Selected(
        start, max(end, cursor), applied, doc.text[doc.line_start(line) : start] + applied
    )


def _exact_offset(doc: Document, pos) -> int | None:
    """The offset of a position inside its line, None for one past it or inside a character."""
    line, character = int(pos.line), int(pos.character)
    if not 0 <= line < doc.line_count or character < 0:
        return None
    start = doc.line_start(line)
    resolved = doc.resolve(pos)
    if resolved.clamped or not start <= resolved.offset <= doc.line_end(line):
        return None
    return resolved.offset


def with_selected(ctx: CompletionContext, sel: Selected) -> CompletionContext | None:
    """`ctx`, built at `sel.end`, as if the selected item were applied; None where the prefix
    does not reach back to the item's range (a line too long for the prompt's budget)."""
    cut = sel.replaced
    if cut > len(ctx.line_prefix) or cut > len(ctx.prefix):
        return None
    applied = encodable(sel.applied)
    line_prefix = ctx.line_prefix[: len(ctx.line_prefix) - cut] + applied
    return replace(
        ctx,
        prefix=ctx.prefix[: len(ctx.prefix) - cut] + applied,
        line_prefix=line_prefix,
        indent=leading_ws(line_prefix + ctx.line_suffix),
    )


def distinct(texts) -> list[str]:
    """The texts in order, without empty, blank or repeated ones."""
    out: list[str] = []
    for text in texts:
        if text and text.strip() and text not in out:
            out.append(text)
    return out
