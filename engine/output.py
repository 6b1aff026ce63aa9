"""From sampled token ids to released text: UTF-8-safe detokenisation, stop strings, EOS and
the token limit, in one place for every generation loop."""

from __future__ import annotations

from engine.stops import StopMatcher
from engine.tokenizer import Tokenizer


class OutputAssembler:
    def __init__(self, tokenizer: Tokenizer, max_tokens: int, stop=(), stop_at_eos: bool = True):
        self.decoder = tokenizer.stream_decoder()
        self.stop = StopMatcher(stop)
        self.eos_ids = set(tokenizer.eos_ids) if stop_at_eos else set()
        self.max_tokens = max_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None  # "eos", "stop", "length", or set by the caller

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, token_id: int) -> str:
        """Take one sampled token; return the text it releases (maybe empty)."""
        if self.finished:
            return ""
        if token_id in self.eos_ids:
            self.finish_reason = "eos"
            return self._close()
        if len(self.token_ids) >= self.max_tokens:  # a budget of 0 releases nothing
            self.finish_reason = "length"
            return self._close()
        self.token_ids.append(token_id)
        delta = self.stop.feed(self.decoder.push(token_id))
        if self.stop.stopped:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_tokens:
            self.finish_reason = "length"
            delta += self._close()
        self.text += delta
        return delta

    def finish(self, reason: str) -> str:
        """End early (cancelled, deadline): release what is held back."""
        if self.finished:
            return ""
        self.finish_reason = reason
        delta = self._close()
        self.text += delta
        return delta

    def _close(self) -> str:
        delta = self.stop.feed(self.decoder.flush())
        if self.stop.stopped:
            self.finish_reason = "stop"
        return delta + self.stop.flush()
