"""Typing-through: when the user types the start of the ghost text on screen, the rest of it is
the answer, with no engine call."""

from __future__ import annotations

from dataclasses import dataclass

# How much text before the cursor must be unchanged for a stored suggestion to still apply.
ANCHOR_CHARS = 256


@dataclass
class Shown:
    uri: str
    offset: int  # code point offset of the cursor when the suggestion was made
    before: str  # the ANCHOR_CHARS of text before that cursor
    text: str  # the suggestion


class SuggestionMemory:
    def __init__(self):
        self._by_uri: dict[str, Shown] = {}
        self.hits = 0

    def remember(self, uri: str, text_before_cursor: str, offset: int, suggestion: str) -> None:
        self._by_uri[uri] = Shown(uri, offset, text_before_cursor[-ANCHOR_CHARS:], suggestion)

    def forget(self, uri: str) -> None:
        self._by_uri.pop(uri, None)

    def continue_from(self, uri: str, document_text: str, offset: int) -> str | None:
        """The rest of the shown suggestion if the text typed since matches its start."""
        shown = self._by_uri.get(uri)
        if shown is None or offset < shown.offset:
            return None
        start = shown.offset - len(shown.before)
        if start < 0 or document_text[start : shown.offset] != shown.before:
            return None
        typed = document_text[shown.offset : offset]
        if not shown.text.startswith(typed) or len(typed) >= len(shown.text):
            return None
        rest = shown.text[len(typed) :]
        if not rest.strip():
            return None
        self.hits += 1
        return rest
