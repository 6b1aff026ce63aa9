"""Speculative decoding of a lone greedy sequence with prompt-lookup drafts.

A draft (engine.decoding.prompt_lookup) is verified by one lean forward over [last token] + draft,
and the tokens greedy decoding would have produced go out one by one through the usual output
path: row j's logits give the next token; the next row counts only if its input, the draft's
token j, is that token. The caller counts a sequence's computed tokens up to the rows whose input
was right, so K/V written for rejected draft tokens lie past them and are never read, nor
registered in the prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.decoding.prompt_lookup import draft, writable_prefix
from engine.decoding.sampling import GREEDY_BELOW
from engine.decoding.token_healing import Forcing


class Speculation:
    def __init__(self, never_drafted: frozenset[int], ending_ids: frozenset[int], max_rows: int):
        self.never_drafted = never_drafted  # ids greedy decoding never writes: a draft stops there
        self.ending_ids = ending_ids  # an ending token ends a draft
        self.max_rows = max_rows  # rows one lean forward takes
        self.drafted = 0  # draft tokens verified
        self.accepted = 0  # of them, those greedy decoding wrote

    def applies(self, temperature: float, forcing: Forcing | None) -> bool:
        """Greedy, and no healed text left to write (a draft knows nothing of that constraint)."""
        return temperature < GREEDY_BELOW and not (forcing is not None and forcing.active)

    def step(
        self,
        tokens: list[int],
        room: int,
        stop_at_eos: bool,
        verify: Callable[[list[int]], torch.Tensor | None],
        accept: Callable[[int, torch.Tensor], int | None],
    ) -> int:
        """One verify forward and its accepted tokens out; the number of rows released (0:
        nothing done, where there is no draft or no verify).

        `tokens`: the sequence's (prompt, then generated); `room`: tokens it may still take (its
        blocks' and its output's, whichever is fewer). `verify(rows)`: logits [rows, V] of the
        last token and the draft, or None where the lean path declines. `accept(row, logits)`
        releases row's token and gives it, or None once the output has finished; the caller
        counts the rows up to `row` as computed before it does."""
        proposal = draft(tokens, min(self.max_rows - 1, room - 1))
        proposal = writable_prefix(
            proposal, self.never_drafted, self.ending_ids if stop_at_eos else ()
        )
        if not proposal:
            return 0
        rows = [tokens[-1]] + proposal
        logits = verify(rows)
        if logits is None:
            return 0
        self.drafted += len(proposal)
        for j, drafted in enumerate(proposal):
            token = accept(j, logits[j])
            if token is None or token != drafted:
                return j + 1
            self.accepted += 1
        accept(len(proposal), logits[-1])  # the whole draft was right: the last row's token too
        return len(rows)
