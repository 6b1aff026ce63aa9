"""Accounting: the engine's running totals and each finished request's usage."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.core.state import RequestState


@dataclass
class Counters:
    requests: int = 0  # submitted
    completed: int = 0  # ended by their output: a stop, an ending token, the budget
    cancelled: int = 0  # cancelled, superseded or past their deadline
    failed: int = 0  # refused or failed
    prompt_tokens: int = 0  # of admitted requests
    cache_hit_tokens: int = 0  # of those, served from the prefix cache

    def as_dict(self) -> dict:
        return asdict(self)


def request_usage(state: RequestState, now: float) -> dict:
    """A finished request's tokens and times: `first_token_ms` and `total_ms` from its
    submission; `decode_ms` from the end of its prompt's prefill to its end (0 where the prompt
    never finished), the time its tokens after the first took: a beam search releases its first
    token only at its end."""
    return dict(
        prompt_tokens=len(state.request.prompt_ids),
        cached_tokens=state.cached,
        completion_tokens=state.output.completion_tokens if state.output else 0,
        queue_ms=1000 * ((state.started or now) - state.submitted),
        prefill_ms=1000 * state.prefill_s,
        first_token_ms=1000 * (state.first_token - state.submitted) if state.first_token else None,
        decode_ms=1000 * (now - state.prompt_done) if state.prompt_done else 0.0,
        total_ms=1000 * (now - state.submitted),
    )
