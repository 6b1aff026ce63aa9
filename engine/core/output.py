"""The output stage: from sampled token ids to released text (UTF-8-safe detokenisation, stop
strings, EOS and the token limit), one per request, for every generation path of the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.decoding.stops import StopMatcher
from engine.decoding.token_healing import forcing_for
from engine.loading.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.core.request import TokenBudget
    from engine.core.state import RequestState


class OutputAssembler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_tokens: int,
        stop=(),
        stop_at_eos: bool = True,
        skip_text: str = "",
    ):
        # skip_text: what the first tokens are forced to write (engine.decoding.token_healing),
        # which the caller already has; it is neither released nor matched against the stop
        # strings, and the tokens that write it do not count against max_tokens.
        self.skip_text = skip_text
        self.forced_tokens = 0
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

    @property
    def completion_tokens(self) -> int:
        """Tokens generated after the forced text."""
        return len(self.token_ids) - self.forced_tokens

    def push(self, token_id: int) -> str:
        """Take one sampled token; return the text it releases (maybe empty)."""
        if self.finished:
            return ""
        if token_id in self.eos_ids:
            self.finish_reason = "eos"
            return self._close()
        if self.completion_tokens >= self.max_tokens:  # a budget of 0 releases nothing
            self.finish_reason = "length"
            return self._close()
        self.token_ids.append(token_id)
        self.forced_tokens += bool(self.skip_text)
        delta = self.stop.feed(self._unskipped(self.decoder.push(token_id)))
        if self.stop.stopped:
            self.finish_reason = "stop"
        elif self.completion_tokens >= self.max_tokens:
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

    def _unskipped(self, text: str) -> str:
        skip = self.skip_text
        if not skip:
            return text
        if skip.startswith(text):
            self.skip_text = skip[len(text) :]
            return ""
        self.skip_text = ""
        # Under the constraint the text starts with what is skipped; were it not, release it all.
        return text[len(skip) :] if text.startswith(skip) else text

    def _close(self) -> str:
        delta = self.stop.feed(self._unskipped(self.decoder.flush()))
        if self.stop.stopped:
            self.finish_reason = "stop"
        return delta + self.stop.flush()


class OutputSetup:
    """Sets up a completion's output when it is admitted, once its budget is known: its
    assembler, its healing constraint and its seeded generator."""

    def __init__(self, tokenizer: Tokenizer, device: torch.device):
        self.tokenizer, self.device = tokenizer, device

    def __call__(self, state: RequestState, budget: TokenBudget) -> None:
        req = state.request
        state.output = OutputAssembler(
            self.tokenizer, budget.completion, req.stop, req.stop_at_eos, skip_text=req.forced_text
        )
        state.forcing = forcing_for(self.tokenizer, req.forced_text)
        if req.seed is not None:
            state.generator = torch.Generator(device=self.device).manual_seed(req.seed)
