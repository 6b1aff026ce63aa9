"""Which language a document is in, and its tree-sitter parser.

Detection trusts the client's LSP languageId first and falls back to the file extension.
Languages without a grammar here are plain text: no tree, text-only context.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import Any


@dataclass(frozen=True)
class Language:
    name: str  # our canonical name, e.g. "typescriptreact" is "tsx"
    grammar: str | None  # tree-sitter-language-pack name; None: plain text
    extensions: tuple[str, ...] = ()
    language_ids: tuple[str, ...] = ()
    line_comment: str = "#"
    braces: bool = True  # blocks are delimited by { } rather than indentation

    @property
    def has_parser(self) -> bool:
        return self.grammar is not None


PLAIN_TEXT = Language("plaintext", None, line_comment="#", braces=False)

LANGUAGES: tuple[Language, ...] = (
    Language("python", "python", (".py", ".pyi", ".pyw"), ("python",), "#", braces=False),
    Language(
        "javascript",
        "javascript",
        (".js", ".mjs", ".cjs", ".jsx"),
        ("javascript", "javascriptreact", "jsx"),
        "//",
    ),
    Language("typescript", "typescript", (".ts", ".mts", ".cts"), ("typescript",), "//"),
    Language("tsx", "tsx", (".tsx",), ("typescriptreact", "tsx"), "//"),
    Language("go", "go", (".go",), ("go",), "//"),
    Language("rust", "rust", (".rs",), ("rust",), "//"),
    Language("c", "c", (".c", ".h"), ("c",), "//"),
    Language(
        "cpp",
        "cpp",
        (".cc", ".cpp", ".cxx", ".c++", ".hh", ".hpp", ".hxx", ".h++", ".ipp", ".tpp"),
        ("cpp", "cuda-cpp", "c++"),
        "//",
    ),
    Language("java", "java", (".java",), ("java",), "//"),
)

_BY_ID = {lid: lang for lang in LANGUAGES for lid in lang.language_ids}
_BY_EXT = {ext: lang for lang in LANGUAGES for ext in lang.extensions}
_BY_NAME = {lang.name: lang for lang in LANGUAGES}


def detect_language(language_id: str | None = None, path: str | None = None) -> Language:
    """The Language for an LSP languageId and/or a path; PLAIN_TEXT when unknown."""
    if language_id:
        lang = _BY_ID.get(language_id.lower())
        if lang is not None:
            return lang
    if path:
        ext = os.path.splitext(path)[1].lower()
        lang = _BY_EXT.get(ext)
        if lang is not None:
            return lang
    return PLAIN_TEXT


def language_by_name(name: str) -> Language:
    return _BY_NAME.get(name, PLAIN_TEXT)


@cache
def _ts_language(grammar: str) -> Any:
    # Imported here: loading the grammar pack takes time the server need not spend at start.
    from tree_sitter_language_pack import get_language

    return get_language(grammar)


def ts_language(lang: Language) -> Any:
    """tree-sitter Language object, or None for plain text."""
    return _ts_language(lang.grammar) if lang.grammar else None


@cache
def _parser(grammar: str) -> Any:
    from tree_sitter import Parser

    return Parser(_ts_language(grammar))


def get_parser(lang: Language) -> Any:
    """A shared tree-sitter Parser (the server parses on one thread), or None."""
    return _parser(lang.grammar) if lang.grammar else None
