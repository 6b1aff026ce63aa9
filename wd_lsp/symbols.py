"""Definitions and imports of a document, from tree-sitter queries; cached per text version."""

from __future__ import annotations

import os
import re
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .document import Document
from .languages import Language, ts_language
from .queries import DEFINITIONS, IMPORTS


@dataclass(frozen=True)
class Definition:
    name: str
    start: int  # code point offsets of the whole definition node
    end: int
    start_line: int
    end_line: int
    body_line: int  # first line of the body (== start_line when there is no separate body)


@dataclass(frozen=True)
class Import:
    text: str  # the module path as written, quotes stripped
    segments: tuple[str, ...]  # path segments: "pkg.util" -> ("pkg", "util")
    relative: bool  # "./x", ".x", "super::x": resolved next to the importing file


@lru_cache(maxsize=None)
def _query(grammar: str, kind: str) -> Any:
    from tree_sitter import Query

    source = DEFINITIONS[grammar] if kind == "definitions" else IMPORTS[grammar]
    return Query(ts_language_for(grammar), source)


def ts_language_for(grammar: str) -> Any:
    return ts_language(Language(grammar, grammar))


def _matches(doc: Document, kind: str) -> list[tuple[int, dict[str, list[Any]]]]:
    from tree_sitter import QueryCursor

    tree = doc.tree
    if tree is None or doc.language.grammar is None:
        return []
    return QueryCursor(_query(doc.language.grammar, kind)).matches(tree.root_node)


# Per document: kind -> (generation, value); weak so closed documents drop their entries.
_cache: "weakref.WeakKeyDictionary[Document, dict[str, tuple[int, Any]]]" = weakref.WeakKeyDictionary()


def _cached(doc: Document, kind: str, compute: Any) -> Any:
    entries = _cache.setdefault(doc, {})
    hit = entries.get(kind)
    if hit is not None and hit[0] == doc.generation:
        return hit[1]
    value = compute(doc)
    entries[kind] = (doc.generation, value)
    return value


def definitions(doc: Document) -> list[Definition]:
    """All definitions in `doc`, in document order."""
    return _cached(doc, "definitions", _definitions)


def _definitions(doc: Document) -> list[Definition]:
    found: dict[tuple[int, str], Definition] = {}
    for _, caps in _matches(doc, "definitions"):
        nodes, names = caps.get("definition"), caps.get("name")
        if not nodes or not names:
            continue
        node, name_node = nodes[0], names[0]
        body = node.child_by_field_name("body")
        start = doc.offset_of_byte(node.start_byte)
        key = (start, _node_text(doc, name_node))
        if key in found:
            continue
        start_line = doc.line_at(start)
        body_line = doc.line_at(doc.offset_of_byte(body.start_byte)) if body else start_line
        end = doc.offset_of_byte(node.end_byte)
        found[key] = Definition(key[1], start, end, start_line, doc.line_at(end), body_line)
    return sorted(found.values(), key=lambda d: (d.start, d.name))


def imports(doc: Document) -> list[Import]:
    """Modules/files that `doc` imports, in document order."""
    return _cached(doc, "imports", _imports)


def _imports(doc: Document) -> list[Import]:
    out: list[Import] = []
    for _, caps in _matches(doc, "imports"):
        req = caps.get("_require")
        if req and _node_text(doc, req[0]) != "require":
            continue
        for node in caps.get("import", []):
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
        while matched < len(want) and matched < len(mod) and mod[-1 - matched] == want[-1 - matched]:
            matched += 1
        if matched >= min(len(want), 2) or imp.relative:
            return True
    return False
