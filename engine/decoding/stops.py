"""Stop strings over streamed text: cut at the first stop, and never emit text that might turn
out to be the start of one."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str] | tuple[str, ...]):
        self.stops = [s for s in stops if s]
        self.text = ""  # everything generated so far
        self.emitted = 0  # characters of `text` already released
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add generated text; return what can be released now. Sets `stopped` at a stop string."""
        if self.stopped:
            return ""
        start = max(0, self.emitted - max((len(s) for s in self.stops), default=0))
        self.text += delta
        cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = self.text[:cut]
            return self._release(cut)
        return self._release(len(self.text) - self._held_back())

    def flush(self) -> str:
        """At the end of generation nothing is a partial stop any more."""
        return self._release(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.text) - self.emitted), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _release(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out
