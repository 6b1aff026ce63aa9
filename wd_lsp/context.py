"""Completion context: the FIM split at the cursor, trimmed to a token budget, plus extras.

Prefix and suffix are cut at line starts, preferably where a syntax node starts or ends, so
the model never sees half a token or half a statement at the edges. The prefix's first line
moves in coarse steps (node boundaries or multiples of `PREFIX_CUT_STEP` lines): as the user
types, the start of the prompt stays byte-identical and the engine's prefix cache stays warm.

Extra chunks come from other open documents (and far parts of this one): definitions of the
names used near the cursor, outlines of open files this one imports, and recently edited
regions. They are chosen by relevance but emitted in stable-first order (`ContextChunk.kind`
order: import, definition, recent_edit), because a prompt's early part should change least.

Every string of a context is valid Unicode, ready to be encoded as UTF-8 for the engine: a lone
surrogate in a document (legal in JSON, kept in the document's text) is U+FFFD here.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from . import symbols
from .document import Document, Position, PositionLike
from .indent import detect_indent_unit, leading_ws

TokenCounter = Callable[[str], int]

# A token is never longer than this many characters (long whitespace runs come close): text
# longer than budget * this cannot fit, so the search for a cut starts no further back.
MAX_CHARS_PER_TOKEN = 32
PREFIX_CUT_STEP = 16
MAX_DEFINITIONS_PER_NAME = 2
# The indentation style is read from this much of the text: enough to see it, cheap per call.
INDENT_SAMPLE_CHARS = 16_384
CHUNK_KINDS = ("import", "definition", "recent_edit")  # stable first
# Fitting a budget to a model's context: the FIM markers' tokens, and the share of the room the
# estimated count may fill (code runs as dense as ~3 characters a token, against the 3.5 assumed).
PROMPT_MARKER_TOKENS = 8
ESTIMATE_MARGIN = 0.8
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Budget:
    prefix_tokens: int = 1536
    suffix_tokens: int = 512
    extra_tokens: int = 1024
    # Used when no tokenizer count is given.
    chars_per_token: float = 3.5
    max_definition_lines: int = 40
    recent_edit_radius: int = 3  # lines kept either side of a recent edit
    names_lines_before: int = 30  # where to look for names used near the cursor
    names_lines_after: int = 5

    def fitted(self, max_context: int | None, max_tokens: int) -> Budget:
        """This budget shrunk to a model whose context (the longest row it was trained on) is
        `max_context` tokens, leaving room for the reply. Tokens are estimated from characters,
        so the prompt keeps a margin under the engine's own limit. Code denser than ~2.8
        characters a token still overruns it (rarely, on long files); the engine then drops
        whole lines from the prefix's start, in steps, so the cut stays put while the user
        types. Extra chunks get only what the prefix's cap leaves, so none below ~2,900
        tokens."""
        if not max_context:
            return self
        room = max(0, max_context - max(max_tokens, 1) - PROMPT_MARKER_TOKENS)
        suffix = min(self.suffix_tokens, room // 4)
        usable = int((room - suffix) * ESTIMATE_MARGIN)  # for the prefix first, then extra chunks
        prefix = min(self.prefix_tokens, usable)
        extra = min(self.extra_tokens, usable - prefix)
        return replace(self, prefix_tokens=prefix, suffix_tokens=suffix, extra_tokens=extra)


@dataclass(frozen=True)
class ContextChunk:
    kind: str  # "import" (outline of an imported file) | "definition" | "recent_edit"
    uri: str
    path: str  # as the model should see it: relative to the root when one is given
    text: str
    start_line: int


@dataclass(frozen=True)
class CompletionContext:
    uri: str
    path: str
    language: str  # Language.name; "plaintext" when there is no parser
    position: Position  # the cursor after clamping
    position_clamped: bool
    offset: int  # code point offset of the cursor
    prefix: str
    suffix: str
    chunks: tuple[ContextChunk, ...]
    line_prefix: str  # cursor line up to the cursor
    line_suffix: str  # rest of the cursor line
    mid_line: bool  # non-blank text follows the cursor on its line
    indent: str  # leading whitespace of the cursor line
    indent_unit: str  # the document's style: "\t" or N spaces
    prefix_start_line: int
    suffix_end_line: int  # last line (inclusive) whose text is in the suffix
    prefix_truncated: bool
    suffix_truncated: bool
    prefix_tokens: int
    suffix_tokens: int
    extra_tokens: int = 0
    declined: str | None = None  # the document's decline reason, if any
    tree: Any = field(default=None, repr=False, compare=False)


def encodable(s: str) -> str:
    """`s` with each lone surrogate replaced by U+FFFD, so that it encodes as UTF-8. One code
    point for one: lengths and offsets measured on the document's text still hold."""
    if s.isascii():
        return s
    return _SURROGATE.sub("\ufffd", s)


def estimate_counter(chars_per_token: float) -> TokenCounter:
    return lambda s: math.ceil(len(s) / chars_per_token)


def build_context(
    doc: Document,
    position: PositionLike,
    *,
    open_documents: Iterable[Document] = (),
    recent_edits: Sequence[tuple[Document, int]] | None = None,
    budget: Budget = Budget(),
    count_tokens: TokenCounter | None = None,
    root: str | None = None,
) -> CompletionContext:
    """Assemble the context for a completion at `position` in `doc`.

    `open_documents` may include `doc` itself (it is skipped). `recent_edits` lists
    (document, line) pairs, most recent last; by default each document's own log is used.
    """
    count = count_tokens or estimate_counter(budget.chars_per_token)
    resolved = doc.resolve(position)
    offset = resolved.offset
    text = doc.text
    line = doc.line_at(offset)
    line_start, line_end = doc.line_start(line), doc.line_end(line)
    line_prefix, line_suffix = encodable(text[line_start:offset]), encodable(text[offset:line_end])

    tree = doc.tree
    prefix_start, prefix_line = trim_prefix(doc, offset, budget.prefix_tokens, count, tree)
    suffix_end, suffix_line = trim_suffix(doc, offset, budget.suffix_tokens, count, tree)
    prefix, suffix = encodable(text[prefix_start:offset]), encodable(text[offset:suffix_end])

    others = [d for d in open_documents if d is not doc]
    if recent_edits is None:
        recent_edits = [(d, l) for d in [*others, doc] for l in d.recent_edit_lines]
    chunks, extra = select_chunks(
        doc, offset, (prefix_line, suffix_line), others, recent_edits, budget, count, root
    )
    return CompletionContext(
        uri=doc.uri,
        path=encodable(display_path(doc.path, root)),
        language=doc.language.name,
        position=doc.position_at(offset),
        position_clamped=resolved.clamped,
        offset=offset,
        prefix=prefix,
        suffix=suffix,
        chunks=tuple(chunks),
        line_prefix=line_prefix,
        line_suffix=line_suffix,
        mid_line=bool(line_suffix.strip()),
        indent=leading_ws(line_prefix + line_suffix),
        indent_unit=detect_indent_unit(
            text[:INDENT_SAMPLE_CHARS], "\t" if doc.language.name == "go" else "    "
        ),
        prefix_start_line=prefix_line,
        suffix_end_line=suffix_line,
        prefix_truncated=prefix_start > 0,
        suffix_truncated=suffix_end < len(text),
        prefix_tokens=count(prefix),
        suffix_tokens=count(suffix),
        extra_tokens=extra,
        declined=doc.decline_reason,
        tree=tree,
    )


# ---- prefix / suffix trimming ---------------------------------------------------------


def trim_prefix(
    doc: Document, offset: int, budget: int, count: TokenCounter, tree: Any = None
) -> tuple[int, int]:
    """(start offset, start line) of the longest prefix that fits `budget` tokens."""
    text = doc.text
    cur = doc.line_at(offset)
    head_start = doc.line_start(cur)
    if count(text[head_start:offset]) > budget:
        # One enormous line (minified code): keep its tail, cut at a space if there is one.
        return _cut_line_tail(text, head_start, offset, budget, count), cur
    lowest = doc.line_at(max(0, offset - budget * MAX_CHARS_PER_TOKEN))
    if count(text[doc.line_start(lowest) : offset]) <= budget:
        if lowest == 0:
            return 0, 0
    # smallest line whose start keeps the prefix within budget; fits() is monotone in line
    lo, hi = lowest, cur
    while lo < hi:
        mid = (lo + hi) // 2
        if count(text[doc.line_start(mid) : offset]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    first = lo
    if first == 0:
        return 0, 0
    snapped = _node_start_line_at_or_after(doc, tree, first, cur)
    if snapped is not None:
        first = snapped
    else:
        first = min(cur, -(-first // PREFIX_CUT_STEP) * PREFIX_CUT_STEP)
    return doc.line_start(first), first


def trim_suffix(
    doc: Document, offset: int, budget: int, count: TokenCounter, tree: Any = None
) -> tuple[int, int]:
    """(end offset, last line) of the longest suffix that fits `budget` tokens.

    The rest of the cursor line is always kept: it is what the completion must connect to.
    """
    text = doc.text
    cur = doc.line_at(offset)
    last_line = doc.line_count - 1

    def end_of(line: int) -> int:
        return doc.line_start(line + 1) if line < last_line else len(text)

    if count(text[offset : end_of(cur)]) > budget or cur == last_line:
        return end_of(cur), cur
    highest = doc.line_at(min(len(text), offset + budget * MAX_CHARS_PER_TOKEN))
    if count(text[offset : end_of(highest)]) <= budget:
        if highest == last_line:
            return len(text), last_line
    lo, hi = cur, highest
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text[offset : end_of(mid)]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    last = lo
    snapped = _node_end_line_at_or_before(doc, tree, cur, last)
    if snapped is not None:
        last = snapped
    return end_of(last), last


def _cut_line_tail(text: str, start: int, offset: int, budget: int, count: TokenCounter) -> int:
    lo, hi = start, offset
    while lo < hi:
        mid = (lo + hi) // 2
        if count(text[mid:offset]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    space = text.find(" ", lo, offset)
    return space + 1 if space != -1 else lo


def _levels(tree: Any, line: int, depth: int = 3):
    """Sibling lists around `line`, outermost first: top-level nodes, then the children
    (or body's children) of the node that spans `line`, and so on."""
    node = tree.root_node
    for _ in range(depth):
        kids = node.named_children
        yield kids
        spanning = [k for k in kids if k.start_point[0] < line < k.end_point[0]]
        if not spanning:
            return
        node = spanning[0]
        body = node.child_by_field_name("body")
        if body is not None and body.start_point[0] <= line <= body.end_point[0]:
            node = body


def _node_start_line_at_or_after(doc: Document, tree: Any, first: int, cur: int) -> int | None:
    """First line in [first, cur] where a node starts, at the outermost level that has one
    close enough to `first` (losing at most a quarter of the kept lines)."""
    if tree is None:
        return None
    for siblings in _levels(tree, first):
        for node in siblings:
            row = node.start_point[0]
            # rows count "\n" only; a clean cut needs the node to start its line
            if first <= row <= cur and row < doc.line_count:
                if (row - first) * 4 <= cur - first and not doc.line_text(row)[
                    : node.start_point[1]
                ].strip():
                    return row
                break
    return None


def _node_end_line_at_or_before(doc: Document, tree: Any, cur: int, last: int) -> int | None:
    """Last line in (cur, last] where a node ends, outermost level first (same loss rule)."""
    if tree is None:
        return None
    for siblings in _levels(tree, last):
        ends = [
            n.end_point[0]
            for n in siblings
            if cur < n.end_point[0] <= last and n.start_point[0] > cur
        ]
        if ends and (last - max(ends)) * 4 <= last - cur:
            return max(ends)
    return None


# ---- extra chunks ---------------------------------------------------------------------

_IDENT = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")


def names_near(doc: Document, offset: int, before: int, after: int) -> list[str]:
    """Identifiers around the cursor, nearest first."""
    line = doc.line_at(offset)
    lo = doc.line_start(max(0, line - before))
    hi = doc.line_end(min(doc.line_count - 1, line + after))
    nearest: dict[str, int] = {}
    for m in _IDENT.finditer(doc.text, lo, hi):
        if len(m.group()) < 2:
            continue
        d = offset - m.end() if m.end() <= offset else m.start() - offset
        if d < nearest.get(m.group(), 1 << 60):
            nearest[m.group()] = d
    return sorted(nearest, key=lambda n: nearest[n])


def select_chunks(
    doc: Document,
    offset: int,
    window: tuple[int, int],
    others: Sequence[Document],
    recent_edits: Sequence[tuple[Document, int]],
    budget: Budget,
    count: TokenCounter,
    root: str | None,
) -> tuple[list[ContextChunk], int]:
    """Pick extra chunks by relevance within budget; return them in stable-first order."""
    left = budget.extra_tokens
    picked: list[ContextChunk] = []
    taken: dict[str, list[tuple[int, int]]] = {}  # uri -> line spans already shown

    def visible(d: Document, a: int, b: int) -> bool:
        if d is doc and a <= window[1] and b >= window[0]:
            return True  # already in prefix/suffix
        return any(a <= y and b >= x for x, y in taken.get(d.uri, ()))

    outlined: set[str] = set()

    def take(kind: str, d: Document, a: int, b: int, text: str | None = None) -> bool:
        nonlocal left
        if kind == "import":
            # an outline summarises the whole file; it does not hide its definitions
            if d.uri in outlined:
                return False
            outlined.add(d.uri)
        elif visible(d, a, b):
            return False
        if text is None:
            text = d.text[d.line_start(a) : d.line_end(b)]
        if not text.strip():
            return False
        cost = count(text)
        if cost > left:
            return False
        left -= cost
        if kind != "import":
            taken.setdefault(d.uri, []).append((a, b))
        picked.append(
            ContextChunk(kind, d.uri, encodable(display_path(d.path, root)), encodable(text), a)
        )
        return True

    if doc.decline_reason is None:
        # 1. definitions of names used near the cursor, nearest name first
        cur_line = doc.line_at(offset)
        by_name: dict[str, list[tuple[Document, symbols.Definition]]] = {}
        own = symbols.definitions_outside(doc, *window)
        searched = [(o, symbols.definitions(o)) for o in others if o.decline_reason is None]
        for d, defs in [(doc, own)] + searched:
            for definition in defs:
                by_name.setdefault(definition.name, []).append((d, definition))
        names = names_near(doc, offset, budget.names_lines_before, budget.names_lines_after)
        for name in names:
            # a name defined in many places (a common method name) is not worth many chunks
            for d, definition in by_name.get(name, ())[:MAX_DEFINITIONS_PER_NAME]:
                if d is doc and definition.start_line <= cur_line <= definition.end_line:
                    continue  # the enclosing definition: its nearby part is in the prefix
                end = min(
                    definition.end_line, definition.start_line + budget.max_definition_lines - 1
                )
                take("definition", d, definition.start_line, end)
            if left <= 0:
                break

        # 2. outlines (signatures) of open files this one imports
        for imp in symbols.imports_around(doc, *window):
            for d in others:
                if d.decline_reason is None and symbols.imports_file(imp, d.path, d.language.name):
                    outline = outline_of(d)
                    if outline:
                        take("import", d, 0, d.line_count - 1, outline)

    # 3. recently edited regions, most recent first
    radius = budget.recent_edit_radius
    for d, line in reversed(list(recent_edits)):
        if d.decline_reason is not None or line >= d.line_count:
            continue
        take("recent_edit", d, max(0, line - radius), min(d.line_count - 1, line + radius))

    order = {k: i for i, k in enumerate(CHUNK_KINDS)}
    recency = {id(c): i for i, c in enumerate(picked)}

    def stable_key(c: ContextChunk) -> tuple:
        if c.kind == "recent_edit":  # oldest first: the newest edit is the most volatile
            return (order[c.kind], -recency[id(c)])
        return (order[c.kind], c.path, c.start_line)

    picked.sort(key=stable_key)
    return picked, budget.extra_tokens - left


def outline_of(doc: Document, max_lines: int = 60) -> str:
    """Signature lines of a document's definitions: its API at a glance."""
    lines: list[str] = []
    seen: set[int] = set()
    for d in symbols.definitions(doc):
        last = (
            d.body_line - 1
            if not doc.language.braces and d.body_line > d.start_line
            else d.body_line
        )
        for ln in range(d.start_line, max(d.start_line, last) + 1):
            if ln not in seen:
                seen.add(ln)
                lines.append(doc.line_text(ln))
        if len(lines) >= max_lines:
            break
    return "\n".join(lines[:max_lines])


def display_path(path: str, root: str | None) -> str:
    if root:
        try:
            rel = os.path.relpath(path, root)
        except ValueError:
            return path
        if not rel.startswith(".."):
            return rel
    return path
