"""How long a completion request waits after a keystroke before it asks the engine.

A request sent while the user is still typing is superseded by the next keystroke; waiting for a
pause skips those, but every suggestion then comes that much later. The adaptive rule
(setting `debounce: "adaptive"`, the default) waits until

    wait = min(1.5 x typing, engine), at most MAX_WAIT_MS

has passed since the document's last edit, where
- typing: the median of the document's last INTERVALS_KEPT intervals between edits, counting only
  those under PAUSE_MS (longer gaps are pauses, not typing). With fewer than MIN_INTERVALS of them
  the wait is the fixed `debounceMs`;
- engine: the median time the engine took for the last LATENCIES_KEPT completions (no bound
  before the first). Waiting longer than the engine takes saves nothing: a request sent too early
  costs at most its own engine time (the next keystroke cancels it), while the wait delays every
  suggestion.

So a fast typist on a fast engine waits little, and a pause about one and a half keystrokes long
starts the request. `debounce: "fixed"` always waits `debounceMs` after the request, as before.
A request the user asked for (trigger kind Invoked) never waits.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

PAUSE_MS = 1000.0
INTERVALS_KEPT = 16
MIN_INTERVALS = 4
LATENCIES_KEPT = 16
TYPING_FACTOR = 1.5
MAX_WAIT_MS = 400.0
DOCUMENTS_KEPT = 64  # documents whose typing is remembered, the most recently edited


class Debounce:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._last_edit: dict[str, float] = {}
        self._intervals: dict[str, deque[float]] = {}
        self._engine_ms: deque[float] = deque(maxlen=LATENCIES_KEPT)
        self.last_wait_ms: float | None = None  # the wait of the last request, for the status

    def edited(self, uri: str) -> None:
        """The document changed now (a didChange)."""
        now = self.clock()
        last = self._last_edit.pop(uri, None)  # re-inserted: the dict stays in edit order
        self._last_edit[uri] = now
        if last is not None and 1000 * (now - last) < PAUSE_MS:
            self._intervals.setdefault(uri, deque(maxlen=INTERVALS_KEPT)).append(
                1000 * (now - last)
            )
        while len(self._last_edit) > DOCUMENTS_KEPT:
            oldest = next(iter(self._last_edit))
            self.forget(oldest)

    def forget(self, uri: str) -> None:
        self._last_edit.pop(uri, None)
        self._intervals.pop(uri, None)

    def engine_took(self, ms: float) -> None:
        self._engine_ms.append(ms)

    def typing_ms(self, uri: str) -> float | None:
        """The document's typical interval between keystrokes, once enough are known."""
        intervals = self._intervals.get(uri)
        if not intervals or len(intervals) < MIN_INTERVALS:
            return None
        return statistics.median(intervals)

    def engine_ms(self) -> float | None:
        return statistics.median(self._engine_ms) if self._engine_ms else None

    def wait_ms(self, uri: str, fixed_ms: float) -> float:
        """The adaptive wait after the document's last edit (the rule above)."""
        typing = self.typing_ms(uri)
        if typing is None:
            return float(fixed_ms)
        wait = TYPING_FACTOR * typing
        engine = self.engine_ms()
        if engine is not None:
            wait = min(wait, engine)
        return min(wait, MAX_WAIT_MS)

    def remaining_s(self, uri: str, mode: str, fixed_ms: float, invoked: bool = False) -> float:
        """Seconds this request should still wait, from now."""
        if invoked:
            self.last_wait_ms = 0.0
            return 0.0
        if mode == "fixed":
            self.last_wait_ms = float(fixed_ms)
            return fixed_ms / 1000
        wait = self.wait_ms(uri, fixed_ms)
        self.last_wait_ms = wait
        last = self._last_edit.get(uri)
        since_ms = 0.0 if last is None else 1000 * (self.clock() - last)
        return max(0.0, wait - since_ms) / 1000
