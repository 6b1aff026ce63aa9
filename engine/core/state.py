"""What the engine keeps of a request while it is in service: its blocks, its tokens, how far
the model has computed them, its output, and its timings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.core.output import OutputAssembler
from engine.core.request import Event, Request
from engine.decoding.beam_search import BeamRun
from engine.decoding.token_healing import Forcing
from engine.kv.sequence import BlockTable

OWNERLESS = "<ownerless>"  # the fairness key of every request without an owner


@dataclass
class RequestState:
    request: Request
    on_event: Callable[[Event], None]
    order: int  # arrival order
    submitted: float
    table: BlockTable | None = None
    tokens: list[int] = field(default_factory=list)  # prompt, then generated tokens
    computed: int = 0  # tokens whose K/V are in the pool
    # Chain hashes of the tokens' full blocks, extended as they grow (the prefix cache's keys).
    block_hashes: list[bytes] = field(default_factory=list)
    room: int = 0  # tokens the blocks taken at admission hold (prompt, forced text, budget)
    cached: int = 0  # prompt tokens served from the prefix cache
    output: OutputAssembler | None = None  # None for a warm-up
    generator: torch.Generator | None = None  # a seeded request's
    forcing: Forcing | None = None  # the healed text its first tokens must write
    beam: BeamRun | None = None  # a beam search in progress
    # The tokens of other lines a beam search found (Request.n > 1), best first.
    alternative_tokens: list[list[int]] = field(default_factory=list)
    cancel_reason: str | None = None
    first_logits: torch.Tensor | None = None  # kept where the request asks for them
    started: float = 0.0  # admitted
    first_token: float = 0.0
    prefill_s: float = 0.0
    prompt_done: float = 0.0  # its last prefill chunk ran: decoding starts

    @property
    def decoding(self) -> bool:
        return self.computed >= len(self.request.prompt_ids)

    @property
    def owner(self) -> str:
        """The fairness key. Requests without an owner share one, so that among them the order
        stays first come, first served (a new one does not take turns with running prefills)."""
        return self.request.owner if self.request.owner is not None else OWNERLESS
