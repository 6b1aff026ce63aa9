"""Speculative decoding of a lone greedy sequence with prompt-lookup drafts.

A draft (engine.decoding.prompt_lookup) is verified by one lean forward over [last token] + draft,
and the tokens greedy decoding would have produced go out one by one through the usual output
path: row j's logits give the next token; the next row counts only if its input, the draft's
token j, is that token. The sequence's `computed` grows by the rows whose input was right, so
K/V written for rejected draft tokens lie past it and are never read, nor registered in the
prefix cache.

`seq` is a running request as the engine keeps it (engine.core.state.RequestState): its tokens,
`computed`, the `room` its blocks hold, its request, output and healing constraint.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.decoding.prompt_lookup import draft, writable_prefix
from engine.decoding.sampling import GREEDY_BELOW


class Speculation:
    def __init__(self, never_drafted: frozenset[int], ending_ids: frozenset[int], max_rows: int):
        self.never_drafted = never_drafted  # ids greedy decoding never writes: a draft stops there
        self.ending_ids = ending_ids  # an ending token ends a draft
        self.max_rows = max_rows  # rows one lean forward takes
        self.drafted = 0  # draft tokens verified
        self.accepted = 0  # of them, those greedy decoding wrote

    def applies(self, seq) -> bool:
        """Greedy, and no healed text left to write (a draft knows nothing of that constraint)."""
        return seq.request.temperature < GREEDY_BELOW and not (
            seq.forcing is not None and seq.forcing.active
        )

    def step(
        self,
        seq,
        verify: Callable[[object, list[int]], torch.Tensor | None],
        accept: Callable[[object, torch.Tensor], None],
    ) -> bool:
        """One verify forward (`verify(seq, rows)`: logits [rows, V], or None where the lean path
        declines) and the accepted tokens through `accept`; False (nothing done) where there is no
        draft or no verify."""
        start = seq.computed
        # Within the blocks taken at admission, and no more than the output can still take
        # (the rows' tokens plus the bonus token).
        remaining = seq.output.max_tokens - seq.output.completion_tokens
        proposal = draft(seq.tokens, min(self.max_rows - 1, seq.room - start - 1, remaining - 1))
        ending = self.ending_ids if seq.request.stop_at_eos else ()
        proposal = writable_prefix(proposal, self.never_drafted, ending)
        if not proposal:
            return False
        rows = [seq.tokens[-1]] + proposal
        logits = verify(seq, rows)
        if logits is None:
            return False
        self.drafted += len(proposal)
        for j in range(len(rows)):
            seq.computed = start + j + 1
            accept(seq, logits[j])
            if seq.output.finished or j == len(proposal) or seq.tokens[-1] != proposal[j]:
                break
            self.accepted += 1
        return True
