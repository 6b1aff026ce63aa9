"""Local acceptance statistics: per language, how many suggestions were shown, accepted whole,
and partially accepted (a word, a line). Kept in the server's memory only, reported by
`wdLsp.status` under `acceptance`, and never sent anywhere else.

Every inline item carries an ID (`issue`) and the command `wdLsp.accepted` with it, which clients
run when the item is accepted; they run `wdLsp.accepted` with kind "word" or "line" on a partial
accept and `wdLsp.shown` when the item is displayed. The server remembers the language of the
last MAX_ITEMS IDs; each counter counts an ID at most once, so a redraw or a second partial
accept of the same item adds nothing. Unknown (or forgotten) and repeated IDs are ignored.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections import OrderedDict

log = logging.getLogger(__name__)

MAX_ITEMS = 4096
# event -> counter; "full" is the command every item carries, "word"/"line" partial accepts.
COUNTERS = {"shown": "shown", "full": "accepted", "word": "partialWord", "line": "partialLine"}
ACCEPT_KINDS = ("full", "word", "line")


class AcceptanceStats:
    def __init__(self, max_items: int = MAX_ITEMS):
        self.max_items = max_items
        self._prefix = uuid.uuid4().hex[:8]  # IDs from an earlier server process never match
        self._numbers = itertools.count(1)
        self._items: OrderedDict[str, tuple[str, set[str]]] = (
            OrderedDict()
        )  # id -> (language, seen)
        self.by_language: dict[str, dict[str, int]] = {}

    def issue(self, language: str) -> str:
        """A new item's ID, remembered with its language (the oldest is forgotten past
        `max_items`)."""
        item_id = f"{self._prefix}-{next(self._numbers)}"
        self._items[item_id] = (language, set())
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)
        return item_id

    def shown(self, item_id) -> bool:
        return self._count(item_id, "shown")

    def accepted(self, item_id, kind="full") -> bool:
        if kind not in ACCEPT_KINDS:
            log.debug("acceptance: unknown kind %r for %r: ignored", kind, item_id)
            return False
        return self._count(item_id, kind)

    def _count(self, item_id, event: str) -> bool:
        """Count `event` for the item; False (and a debug line) for an unknown or repeated one."""
        item = self._items.get(item_id) if isinstance(item_id, str) else None
        if item is None:
            log.debug("acceptance: unknown item %r (%s): ignored", item_id, event)
            return False
        language, seen = item
        if event in seen:
            log.debug("acceptance: item %r already counted as %s: ignored", item_id, event)
            return False
        seen.add(event)
        counts = self.by_language.setdefault(language, dict.fromkeys(COUNTERS.values(), 0))
        counts[COUNTERS[event]] += 1
        return True

    def summary(self) -> dict[str, dict[str, int]]:
        """{language: {"shown", "accepted", "partialWord", "partialLine"}} (copies)."""
        return {language: dict(counts) for language, counts in sorted(self.by_language.items())}


def command_argument(args) -> dict | None:
    """The first argument of `wdLsp.accepted` / `wdLsp.shown` if it is a map, else None."""
    first = args[0] if args else None
    return first if isinstance(first, dict) else None
