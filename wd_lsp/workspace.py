"""The open documents of one editor, and the order in which they were edited.

`encoding` is the position encoding negotiated at initialize; every document opened after it is
set counts its positions in it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from .document import DEFAULT_MAX_BYTES, Document, PositionLike
from .text import UTF16

RECENT_EDITS_KEPT = 32


class Workspace:
    def __init__(
        self, root: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES, encoding: str = UTF16
    ) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.encoding = encoding
        self._docs: dict[str, Document] = {}
        self._edit_order: deque[str] = deque(maxlen=RECENT_EDITS_KEPT)  # uris, newest last

    def open(self, uri: str, text: str, language_id: str = "", version: int = 0) -> Document:
        doc = Document(
            uri, text, language_id, version, max_bytes=self.max_bytes, encoding=self.encoding
        )
        self._docs[uri] = doc
        return doc

    def get(self, uri: str) -> Document | None:
        return self._docs.get(uri)

    def close(self, uri: str) -> None:
        self._docs.pop(uri, None)
        self._edit_order = deque(
            (u for u in self._edit_order if u != uri), maxlen=RECENT_EDITS_KEPT
        )

    def change(
        self,
        uri: str,
        text: str,
        start: PositionLike | None = None,
        end: PositionLike | None = None,
        version: int | None = None,
    ) -> Document | None:
        """Apply one content change; None for a document that was never opened."""
        doc = self._docs.get(uri)
        if doc is None:
            return None
        doc.apply_change(text, start, end, version)
        if not self._edit_order or self._edit_order[-1] != uri:
            self._edit_order.append(uri)
        return doc

    def documents(self) -> Iterable[Document]:
        return self._docs.values()

    def recent_edits(self) -> list[tuple[Document, int]]:
        """(document, line) of recent edits across documents, most recent last."""
        out: list[tuple[Document, int]] = []
        seen: set[str] = set()
        for uri in reversed(self._edit_order):
            if uri in seen or uri not in self._docs:
                continue
            seen.add(uri)
            doc = self._docs[uri]
            out[:0] = [(doc, line) for line in doc.recent_edit_lines]
        return out
