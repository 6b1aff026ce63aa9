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


def request_usage(a: RequestState, now: float) -> dict:
    """A finished request's tokens and times (ms from its submission)."""
    return dict(
        prompt_tokens=len(a.request.prompt_ids),
        cached_tokens=a.cached,
        completion_tokens=a.output.completion_tokens if a.output else 0,
        queue_ms=1000 * ((a.started or now) - a.submitted),
        prefill_ms=1000 * a.prefill_s,
        first_token_ms=1000 * (a.first_token - a.submitted) if a.first_token else None,
        total_ms=1000 * (now - a.submitted),
    )
