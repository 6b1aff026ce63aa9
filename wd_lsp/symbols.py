"""Definitions and imports of a document, from tree-sitter queries; cached per text version."""

from __future__ import annotations

import os
import re
import weakref
from dataclasses import dataclass
from functools import cache
from typing import Any

from .document import Document
from .languages import Language, ts_language
from .queries import DEFINITIONS, IMPORTS


@dataclass(frozen=True)
class Definition:
    name: str
    start_line: int  # lines of the whole definition node, inclusive
    end_line: int
    body_line: int  # first line of the body (== start_line when there is no separate body)

    def shifted(self, lines: int) -> Definition:
        return Definition(
            self.name, self.start_line + lines, self.end_line + lines, self.body_line + lines
        )


@dataclass(frozen=True)
class Import:
    text: str  # the module path as written, quotes stripped
    segments: tuple[str, ...]  # path segments: "pkg.util" -> ("pkg", "util")
    relative: bool  # "./x", ".x", "super::x": resolved next to the importing file

    def shifted(self, lines: int) -> Import:
        return self  # imports carry no positions


@cache
def _query(grammar: str, kind: str) -> Any:
    from tree_sitter import Query

    source = DEFINITIONS[grammar] if kind == "definitions" else IMPORTS[grammar]
    return Query(ts_language_for(grammar), source)


def ts_language_for(grammar: str) -> Any:
    return ts_language(Language(grammar, grammar))


def _matches(doc: Document, kind: str, byte_range: tuple[int, int] | None = None) -> list:
    from tree_sitter import QueryCursor

    tree = doc.tree
    if tree is None or doc.language.grammar is None:
        return []
    cursor = QueryCursor(_query(doc.language.grammar, kind))
    if byte_range is not None:
        cursor.set_byte_range(*byte_range)
    return cursor.matches(tree.root_node)


# Per document: key -> (validity key, value); weak so closed documents drop their entries.
_cache: weakref.WeakKeyDictionary[Document, dict[str, tuple[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)


def _cached(doc: Document, key: str, valid: Any, compute: Any) -> Any:
    entries = _cache.setdefault(doc, {})
    hit = entries.get(key)
    if hit is not None and hit[0] == valid:
        return hit[1]
    value = compute()
    entries[key] = (valid, value)
    return value


def definitions(doc: Document) -> list[Definition]:
    """All definitions in `doc`, in document order (cached until the text changes)."""
    return _cached(
        doc, "definitions", doc.generation, lambda: _definitions(doc, 0, doc.line_count - 1)
    )


def definitions_outside(doc: Document, lo_line: int, hi_line: int) -> list[Definition]:
    """Definitions wholly above `lo_line` or wholly below `hi_line`.

    For the document being typed in: edits happen between the two lines, so each side is
    cached by its own text and the whole-file query is not rerun on every keystroke.
    """
    above = _region(doc, "def_above", 0, lo_line - 1, _definitions)
    below = _region(doc, "def_below", hi_line + 1, doc.line_count - 1, _definitions)
    return above + below


def _region(doc: Document, key: str, first: int, last: int, compute: Any) -> list:
    if first > last or first >= doc.line_count:
        return []
    start, end = doc.line_start(first), doc.line_end(last)
    # keyed by the region's text; values stored relative to its first line
    relative = _cached(
        doc,
        key,
        (hash(doc.text[start:end]), end - start),
        lambda: [d.shifted(-first) for d in compute(doc, first, last)],
    )
    return [d.shifted(first) for d in relative] if first else list(relative)


def _definitions(doc: Document, first: int, last: int) -> list[Definition]:
    if doc.tree is None:
        return []
    row_to_line = _row_mapper(doc)
    lo_byte = doc.byte_offset(doc.line_start(first))
    hi_byte = doc.byte_offset(doc.line_end(last))
    found: dict[tuple[int, str], Definition] = {}
    for _, caps in _matches(doc, "definitions", (lo_byte, hi_byte)):
        nodes, names = caps.get("definition"), caps.get("name")
        if not nodes or not names:
            continue
        node = nodes[0]
        if node.start_byte < lo_byte or node.end_byte > hi_byte:
            continue  # only partly in the region
        name = _node_text(doc, names[0])
        key = (node.start_byte, name)
        if key in found:
            continue
        body = node.child_by_field_name("body")
        start_line = row_to_line(node.start_point[0])
        body_line = row_to_line(body.start_point[0]) if body else start_line
        found[key] = Definition(name, start_line, row_to_line(node.end_point[0]), body_line)
    return [found[k] for k in sorted(found)]


def _row_mapper(doc: Document):
    """tree-sitter rows count "\n" only; our lines also end at a lone "\r"."""
    if doc.line_count == doc.source_bytes.count(b"\n") + 1:
        return lambda row: row
    data = doc.source_bytes

    def to_line(row: int) -> int:
        at = -1
        for _ in range(row):
            at = data.index(b"\n", at + 1)
        return doc.line_at(doc.offset_of_byte(at + 1))

    return to_line


def imports(doc: Document) -> list[Import]:
    """Modules/files that `doc` imports, in document order (cached until the text changes)."""
    return _cached(doc, "imports", doc.generation, lambda: _imports(doc, 0, doc.line_count - 1))


def imports_around(doc: Document, lo_line: int, hi_line: int) -> list[Import]:
    """Same as `imports`, with the parts outside [lo_line, hi_line] cached by their text."""
    above = _region(doc, "imp_above", 0, lo_line - 1, _imports)
    middle = _imports(doc, lo_line, min(hi_line, doc.line_count - 1))
    below = _region(doc, "imp_below", hi_line + 1, doc.line_count - 1, _imports)
    out: list[Import] = []
    for imp in above + middle + below:
        if imp not in out:
            out.append(imp)
    return out


def _imports(doc: Document, first: int, last: int) -> list[Import]:
    if doc.tree is None or first > last:
        return []
    lo_byte = doc.byte_offset(doc.line_start(first))
    hi_byte = doc.byte_offset(doc.line_end(last))
    out: list[Import] = []
    for _, caps in _matches(doc, "imports", (lo_byte, hi_byte)):
        req = caps.get("_require")
        if req and _node_text(doc, req[0]) != "require":
            continue
        for node in caps.get("import", []):
            if node.start_byte < lo_byte:
                continue
            imp = parse_import(_node_text(doc, node), doc.language.name)
            if imp is not None and imp not in out:
                out.append(imp)
    return out


def _node_text(doc: Document, node: Any) -> str:
    return doc.source_bytes[node.start_byte : node.end_byte].decode("utf-8", "replace")


_SPLIT = re.compile(r"::|[./\\]")
_SOURCE_EXT = re.compile(r"\.(js|jsx|mjs|cjs|ts|tsx|mts|cts|py)$")


def parse_import(raw: str, language: str) -> Import | None:
    """Normalise an import's text into path segments."""
    text = raw.strip().strip("\"'`<>").strip()
    if language == "python":
        text = text.split(" as ")[0].strip()
        relative = text.startswith(".")
        segments = [s for s in text.lstrip(".").split(".") if s]
    elif language == "rust":
        text = re.sub(r"\{.*\}|\s+as\s+\w+|::\*$", "", text, flags=re.S).rstrip(":")
        parts = [s for s in text.split("::") if s]
        relative = bool(parts) and parts[0] in ("crate", "self", "super")
        segments = [s for s in parts if s not in ("crate", "self", "super")]
    elif language in ("c", "cpp"):
        relative = raw.strip().startswith('"')
        # keep the extension: foo.h must not pull in foo.c
        segments = [s for s in text.replace("\\", "/").split("/") if s not in ("", ".", "..")]
    else:
        relative = text.startswith(".")
        text = _SOURCE_EXT.sub("", text)
        sep = "." if language == "java" else "/"
        segments = [s for s in text.split(sep) if s not in ("", ".", "..")]
        if language == "java" and segments and segments[-1] == "*":
            segments.pop()
    if not segments:
        return None
    return Import(text, tuple(segments), relative)


_INDEX_STEMS = {"__init__", "index", "mod", "lib"}


def module_path(path: str, language: str) -> tuple[str, ...]:
    """Segments an import would use for a file: "src/pkg/util.py" -> (..., "pkg", "util")."""
    parts = [p for p in path.replace("\\", "/").split("/") if p]
    if not parts:
        return ()
    if language in ("c", "cpp"):
        return tuple(parts)
    stem = os.path.splitext(parts[-1])[0]
    if language == "go":
        return tuple(parts[:-1])  # Go imports packages: the directory
    if stem in _INDEX_STEMS:
        return tuple(parts[:-1])
    return tuple(parts[:-1] + [stem])


def imports_file(imp: Import, path: str, language: str) -> bool:
    """Whether `imp` plausibly refers to the file at `path`.

    Imports name module roots the file system doesn't show (Go module paths, Java source
    roots) and may end in item names (Rust `use a::b::Item`), so any prefix of the import
    may match the end of the file's module path. Two matching segments are required unless
    the import is a single segment or is relative to the importing file.
    """
    mod = module_path(path, language)
    if not mod:
        return False
    segs = imp.segments
    for k in range(len(segs), 0, -1):
        want = segs[:k]
        if mod[-1] != want[-1]:
            continue
        matched = 1
        while (
            matched < len(want) and matched < len(mod) and mod[-1 - matched] == want[-1 - matched]
        ):
            matched += 1
        if matched >= min(len(want), 2) or imp.relative:
            return True
    return False
