"""One open document: its text, LSP positions, incremental edits and a tree-sitter tree.

Offsets in this module are Python string indices (code points) unless named `*_byte`;
LSP positions count columns in the document's position encoding (`wd_lsp.text`);
tree-sitter works on the UTF-8 bytes of the text and counts rows by "\\n" only.
The text is exactly what the client sent, lone surrogates included.
Nothing here raises on bad input from the client: positions are clamped and reported.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol
from urllib.parse import unquote, urlparse

from .languages import Language, detect_language, get_parser
from .text import (
    ENCODINGS,
    UTF16,
    line_of,
    line_starts,
    units_len,
    units_to_index,
    update_line_starts,
)
from .text import (
    encode_utf8 as encode,
)

DEFAULT_MAX_BYTES = 2 * 1024 * 1024
# How much of the text to look at for binary content: enough to be sure, cheap on every edit.
BINARY_SNIFF_CHARS = 8192
RECENT_EDITS_KEPT = 16


class Position(NamedTuple):
    """An LSP position: zero-based line and column in the negotiated position encoding."""

    line: int
    character: int


class PositionLike(Protocol):
    line: int
    character: int


@dataclass(frozen=True)
class ResolvedPosition:
    offset: int  # code point offset into the text
    clamped: bool  # the client's position was outside the text or inside a character


@dataclass(frozen=True)
class AppliedChange:
    start: int  # offsets of the replaced range in the old text
    old_end: int
    new_end: int  # end of the inserted text in the new text
    clamped: bool


class Document:
    """Text of an open document kept in sync with the editor, plus its syntax tree.

    The tree is reparsed lazily: edits only record `tree.edit(...)`, and the next read of
    `tree` reparses once with the old tree, so a burst of changes costs one reparse.
    """

    def __init__(
        self,
        uri: str,
        text: str,
        language_id: str = "",
        version: int = 0,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        encoding: str = UTF16,
    ) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"unknown position encoding {encoding!r}")
        self.uri = uri
        self.encoding = encoding  # units of every position's `character`, in and out
        self.path = uri_to_path(uri)
        self.language_id = language_id
        self.language: Language = detect_language(language_id, self.path)
        self.version = version
        self.max_bytes = max_bytes
        # Lines touched by recent edits (most recent last), shifted as lines come and go.
        self.recent_edit_lines: deque[int] = deque(maxlen=RECENT_EDITS_KEPT)
        self.clamped_positions = 0  # count of client positions that had to be clamped
        self.last_change: AppliedChange | None = None
        self._set_text(text)

    # ---- text and state -------------------------------------------------------------

    @property
    def text(self) -> str:
        return self._text

    @property
    def line_count(self) -> int:
        return len(self._starts)

    @property
    def byte_size(self) -> int:
        return len(self._bytes)

    @property
    def decline_reason(self) -> str | None:
        """Why completions should not be offered here ("binary", "too large"), or None."""
        if self._decline is _UNKNOWN:
            self._decline = self._check_decline()
        return self._decline

    def _check_decline(self) -> str | None:
        if len(self._bytes) > self.max_bytes:
            return "too large"
        if looks_binary(self._text):
            return "binary"
        return None

    def _set_text(self, text: str) -> None:
        self._text = text
        self._bytes = encode(text)
        self._byte_anchor = (0, 0)  # a (code point, byte) offset pair known to match
        self._starts = line_starts(text)
        self._tree: Any = None
        self._tree_stale = True
        self._decline: Any = _UNKNOWN
        self._generation = getattr(self, "_generation", 0) + 1

    @property
    def generation(self) -> int:
        """Bumped on every change; caches keyed on it stay valid until the text moves."""
        return self._generation

    # ---- lines and positions ----------------------------------------------------------

    def line_start(self, line: int) -> int:
        return self._starts[line]

    def line_end(self, line: int) -> int:
        """Offset of the end of `line`'s content (before its line break)."""
        end = self._starts[line + 1] if line + 1 < len(self._starts) else len(self._text)
        while end > self._starts[line] and self._text[end - 1] in "\r\n":
            end -= 1
        return end

    def line_text(self, line: int) -> str:
        return self._text[self._starts[line] : self.line_end(line)]

    def line_at(self, offset: int) -> int:
        return line_of(self._starts, offset)

    def resolve(self, pos: PositionLike) -> ResolvedPosition:
        """Offset for an LSP position; out-of-range positions clamp to the nearest valid one."""
        line, character = int(pos.line), int(pos.character)
        if line < 0:
            return self._clamped(0)
        if line >= len(self._starts):
            return self._clamped(len(self._text))
        start = self._starts[line]
        index, exact = units_to_index(
            self._text[start : self.line_end(line)], character, self.encoding
        )
        if not exact:
            return self._clamped(start + index)
        return ResolvedPosition(start + index, False)

    def _clamped(self, offset: int) -> ResolvedPosition:
        self.clamped_positions += 1
        return ResolvedPosition(offset, True)

    def offset_at(self, pos: PositionLike) -> int:
        return self.resolve(pos).offset

    def position_at(self, offset: int) -> Position:
        """LSP position of a code point offset (clamped into the text)."""
        offset = min(max(offset, 0), len(self._text))
        line = line_of(self._starts, offset)
        start = self._starts[line]
        # An offset between "\r" and "\n" belongs to the line end; report the line's end.
        offset = min(offset, self.line_end(line))
        return Position(line, units_len(self._text[start:offset], self.encoding))

    def byte_offset(self, offset: int) -> int:
        """UTF-8 byte offset of a code point offset.

        Only the text between `offset` and the nearest point whose byte offset is known (the
        start, the end, the end of the last edit: typing stays near it) is encoded.
        """
        if self._bytes_ascii:
            return offset
        anchor, anchor_byte = self._byte_anchor
        to_end = len(self._text) - offset
        if offset <= min(abs(offset - anchor), to_end):
            return len(encode(self._text[:offset]))
        if to_end <= abs(offset - anchor):
            return len(self._bytes) - len(encode(self._text[offset:]))
        if offset >= anchor:
            return anchor_byte + len(encode(self._text[anchor:offset]))
        return anchor_byte - len(encode(self._text[offset:anchor]))

    @property
    def _bytes_ascii(self) -> bool:
        return len(self._bytes) == len(self._text)

    def point_at_byte(self, byte: int) -> tuple[int, int]:
        """tree-sitter point (row by "\\n", byte column) of a byte offset."""
        return point_in(self._bytes, byte)

    # ---- edits ------------------------------------------------------------------------

    def replace_all(self, text: str, version: int | None = None) -> None:
        """A full-text change: drop the tree, parse from scratch next time."""
        self._set_text(text)
        self.recent_edit_lines.clear()
        if version is not None:
            self.version = version

    def apply_change(
        self,
        text: str,
        start: PositionLike | None = None,
        end: PositionLike | None = None,
        version: int | None = None,
    ) -> AppliedChange:
        """Apply one `didChange` content change; without a range it replaces everything.

        `start`/`end` may be this module's Position or lsprotocol's Position.
        """
        if version is not None:
            self.version = version
        if start is None or end is None:
            old_len = len(self._text)
            self.replace_all(text)
            self.last_change = AppliedChange(0, old_len, len(text), False)
            return self.last_change
        a, b = self.resolve(start), self.resolve(end)
        lo, hi = min(a.offset, b.offset), max(a.offset, b.offset)
        self._splice(lo, hi, text)
        self.last_change = AppliedChange(lo, hi, lo + len(text), a.clamped or b.clamped)
        return self.last_change

    def _splice(self, lo: int, hi: int, inserted: str) -> None:
        old_text, old_bytes = self._text, self._bytes
        old_lines = len(self._starts)
        start_byte = self.byte_offset(lo)
        old_end_byte = start_byte + len(encode(old_text[lo:hi]))
        inserted_bytes = encode(inserted)
        new_end_byte = start_byte + len(inserted_bytes)

        # join copies each piece once; `+` would build a large intermediate string too
        new_text = "".join((old_text[:lo], inserted, old_text[hi:]))
        new_bytes = b"".join((old_bytes[:start_byte], inserted_bytes, old_bytes[old_end_byte:]))
        self._starts = update_line_starts(self._starts, new_text, lo, hi, len(inserted))
        self._text, self._bytes = new_text, new_bytes
        self._byte_anchor = (lo + len(inserted), new_end_byte)
        self._decline = _UNKNOWN
        self._generation += 1

        if self._tree is not None:
            self._tree.edit(
                start_byte=start_byte,
                old_end_byte=old_end_byte,
                new_end_byte=new_end_byte,
                start_point=point_in(old_bytes, start_byte),
                old_end_point=point_in(old_bytes, old_end_byte),
                new_end_point=point_in(new_bytes, new_end_byte),
            )
        self._tree_stale = True
        self._note_edit(line_of(self._starts, lo), len(self._starts) - old_lines)

    def _note_edit(self, line: int, lines_added: int) -> None:
        shifted = deque(
            (l + lines_added if l > line else l for l in self.recent_edit_lines if l != line),
            maxlen=RECENT_EDITS_KEPT,
        )
        shifted.append(line)
        self.recent_edit_lines = shifted

    # ---- syntax tree ------------------------------------------------------------------

    @property
    def tree(self) -> Any:
        """The tree-sitter Tree of the current text, or None (plain text, binary, too large)."""
        if not self._tree_stale:
            return self._tree
        parser = get_parser(self.language)
        if parser is None or self.decline_reason is not None:
            self._tree = None
        else:
            self._tree = (
                parser.parse(self._bytes, self._tree) if self._tree else parser.parse(self._bytes)
            )
        self._tree_stale = False
        return self._tree

    @property
    def source_bytes(self) -> bytes:
        """The UTF-8 bytes tree-sitter sees (node.start_byte indexes these)."""
        return self._bytes

    def offset_of_byte(self, byte: int) -> int:
        """Code point offset of a UTF-8 byte offset (e.g. a node's start_byte)."""
        if self._bytes_ascii:
            return byte
        return len(self._bytes[:byte].decode("utf-8", "surrogatepass"))


_UNKNOWN = object()


def point_in(data: bytes, byte: int) -> tuple[int, int]:
    row = data.count(b"\n", 0, byte)
    return row, byte - (data.rfind(b"\n", 0, byte) + 1)


def looks_binary(text: str) -> bool:
    """NUL characters or many undecodable/control characters near the start."""
    head = text[:BINARY_SNIFF_CHARS]
    if "\x00" in text:
        return True
    if not head:
        return False
    bad = sum(1 for c in head if c == "\ufffd" or (c < " " and c not in "\t\n\r\f\v\x1b"))
    return bad / len(head) > 0.05


def uri_to_path(uri: str) -> str:
    """File system path of a file: URI; other schemes keep the URI's path part."""
    parsed = urlparse(uri)
    if parsed.scheme in ("file", ""):
        return unquote(parsed.path) if parsed.scheme else uri
    return unquote(parsed.path) or uri
