"""Typing-through: when the user types the start of a suggestion on screen, the rest of it is the
answer, with no engine call. All of a request's suggestions are kept (an editor may be showing
any one of them); each keeps its acceptance ID, since it is the same suggestion, shorter."""

from __future__ import annotations

from dataclasses import dataclass

# How much text before the cursor must be unchanged for a stored suggestion to still apply.
ANCHOR_CHARS = 256


@dataclass
class Shown:
    uri: str
    offset: int  # code point offset of the cursor when the suggestions were made
    before: str  # the ANCHOR_CHARS of text before that cursor
    suggestions: list[tuple[str, str | None]]  # (text, acceptance ID), best first


class SuggestionMemory:
    def __init__(self):
        self._by_uri: dict[str, Shown] = {}
        self.hits = 0

    def remember(
        self,
        uri: str,
        text_before_cursor: str,
        offset: int,
        suggestions: list[tuple[str, str | None]],
    ) -> None:
        self._by_uri[uri] = Shown(
            uri, offset, text_before_cursor[-ANCHOR_CHARS:], list(suggestions)
        )

    def forget(self, uri: str) -> None:
        self._by_uri.pop(uri, None)

    def continue_from(
        self, uri: str, document_text: str, offset: int
    ) -> list[tuple[str, str | None]]:
        """The rest of each stored suggestion whose start the text typed since matches, in their
        order, with their IDs; [] when none does."""
        shown = self._by_uri.get(uri)
        if shown is None or offset < shown.offset:
            return []
        start = shown.offset - len(shown.before)
        if start < 0 or document_text[start : shown.offset] != shown.before:
            return []
        typed = document_text[shown.offset : offset]
        rests = [
            (text[len(typed) :], item_id)
            for text, item_id in shown.suggestions
            if text.startswith(typed) and len(typed) < len(text) and text[len(typed) :].strip()
        ]
        if rests:
            self.hits += 1
        return rests
