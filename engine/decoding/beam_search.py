"""Beam search for short greedy completions (a single line at the cursor).

Greedy decoding takes the likeliest token at each step; the likeliest whole line can start with a
token that greedy passes over. On the held-out single-line FIM tasks the model often scores the
true line above greedy's output where greedy misses, and a small beam (blank completions not
answered) turns more of those misses into exact matches than it loses (BENCHMARKS.md, "Beam
search for single-line completions").

The search keeps the `width` likeliest unfinished hypotheses (sum of token log-probabilities),
each token constrained as greedy's would be (forbidden ids, the healed text at the cursor). A
hypothesis finishes at an ending token, a stop string or the token budget. Scores only fall as a
hypothesis grows, so the search ends once no unfinished one scores above the best finished one.
A finished hypothesis whose text is blank is the answer only if every finished one is blank: a
suggestion that writes nothing is no suggestion. The caller feeds the chosen tokens through its
usual output path, so stop strings, the healed text and the budget apply exactly as for greedy.

Asked for `alternatives`, the search also keeps the next likeliest finished lines with distinct
texts, for an editor to cycle through: it goes on until no unfinished hypothesis can still enter
the best `1 + alternatives`, and it never looks further than `ALTERNATIVE_MARGIN` below the best
(such lines are not worth showing, and the bound keeps the extra steps few). The answer is the one
it would be without alternatives: the extra hypotheses all score below the best, so they never
take a beam's place from one that could beat it.

`BeamTails` holds the K/V of each beam's own tokens beside the prompt's, which all beams share in
the cache and none writes (Qwen3MoeModel.forward_beams). `BeamRun` is one request's search as the
engine drives it: a step at a time, each step one forward of the beams' rows.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.decoding.sampling import TokenChooser
from engine.decoding.token_healing import Forcing, forcing_for
from engine.loading.tokenizer import Tokenizer

# Alternatives are lines at most this much less likely than the best (in log-probability: e^-3,
# about a twentieth as likely).
ALTERNATIVE_MARGIN = 3.0


@dataclass
class Hypothesis:
    score: float  # sum of the log-probabilities of its tokens
    tokens: list[int]  # the forced tokens, then the completion's
    forcing: Forcing | None
    # Of `tokens`, those written while the healed text was not yet all written.
    forced_tokens: int = 0


class BeamTails:
    """K/V of each beam's own tokens, per layer [B, t, Hkv, D]."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        """Tokens each beam holds (the last layer is extended last)."""
        return 0 if self.keys[-1] is None else self.keys[-1].shape[1]

    def extend(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append each beam's new k, v [B, Hkv, D]; the layer's keys and values [B, t, Hkv, D]."""
        k, v = k[:, None], v[:, None]
        if self.keys[layer] is not None:
            k, v = (
                torch.cat([self.keys[layer], k], dim=1),
                torch.cat([self.values[layer], v], dim=1),
            )
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def mark(self) -> tuple[list, list]:
        """The K/V held now, for `restore` (`extend` makes new tensors, so these stay)."""
        return list(self.keys), list(self.values)

    def restore(self, mark: tuple[list, list]) -> None:
        """Back to the K/V held at `mark`."""
        self.keys, self.values = list(mark[0]), list(mark[1])

    def select(self, parents: list[int]) -> None:
        """Beam i continues old beam parents[i]."""
        if self.keys[0] is None:
            return
        index = torch.tensor(parents)
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]


class BeamSearch:
    def __init__(
        self,
        tokenizer: Tokenizer,
        width: int,
        max_tokens: int,
        stop=(),
        stop_at_eos: bool = True,
        forced_text: str = "",
        chooser: TokenChooser | None = None,
        alternatives: int = 0,
    ):
        """`width` is within 1..MAX_BEAMS, as every request is checked on admission
        (engine.core.request.check_request); `chooser` constrains each token as greedy's, by
        default to what the tokenizer may write; `alternatives`: how many finished lines besides
        the answer to keep (`alternatives()`)."""
        self.tokenizer = tokenizer
        self.width = width
        self.max_tokens = max_tokens
        self.stop = tuple(s for s in stop if s)
        self.ending = set(tokenizer.eos_ids) if stop_at_eos else set()
        self.forced_text = forced_text
        self.chooser = chooser or TokenChooser(tokenizer.unsampled_ids, None)
        self.live = [Hypothesis(0.0, [], forcing_for(tokenizer, forced_text))]
        self.best: Hypothesis | None = None  # the best finished one with text
        self.best_blank: Hypothesis | None = None  # the answer only if nothing else finishes
        self.alternatives_wanted = alternatives
        # Finished hypotheses with text, the likeliest per distinct text (when alternatives are
        # wanted).
        self.finished: dict[str, Hypothesis] = {}

    @property
    def done(self) -> bool:
        return not self.live

    def step(self, logits: torch.Tensor) -> tuple[list[int], list[int]] | None:
        """Take the live hypotheses' next-token logits [B, V] (row i: live hypothesis i); return
        (parents, tokens) to compute next, beam i being old beam parents[i] plus tokens[i], or
        None when the search is over (then `answer()`)."""
        candidates = []
        for row, hyp in enumerate(self.live):
            scores = self.chooser.constrain(logits[row].float(), hyp.forcing)
            # Twice the width, so that hypotheses finishing here leave enough to go on with.
            top = torch.topk(F.log_softmax(scores, dim=-1), min(2 * self.width, scores.shape[-1]))
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                if value != float("-inf"):
                    candidates.append((hyp.score + value, row, token))
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep beam, then rank order
        kept: list[tuple[int, Hypothesis]] = []
        for score, row, token in candidates:
            if len(kept) == self.width or not self._may_win(score):
                break
            parent = self.live[row]
            if token in self.ending:
                self._finished(Hypothesis(score, parent.tokens, None, parent.forced_tokens))
                continue
            forcing = copy.copy(parent.forcing)
            forced = forcing is not None and bool(forcing.remaining)
            if forcing is not None and forcing.active:
                forcing.advance(token)
            hyp = Hypothesis(score, parent.tokens + [token], forcing, parent.forced_tokens + forced)
            text, stopped = self._text(hyp)
            if stopped or len(hyp.tokens) - hyp.forced_tokens >= self.max_tokens:
                self._finished(hyp, text)
            else:
                kept.append((row, hyp))
        # A later finish may beat them.
        kept = [(row, hyp) for row, hyp in kept if self._may_win(hyp.score)]
        self.live = [hyp for _, hyp in kept]
        if not kept:
            return None
        return [row for row, _ in kept], [hyp.tokens[-1] for hyp in self.live]

    def answer(self, partial: bool = False) -> list[int]:
        """The tokens of the likeliest finished hypothesis with text (else, with `partial` (a
        deadline), of the likeliest live one; else of the likeliest blank one; else none): feed
        them through the usual output path."""
        best = self.best or (self.live[0] if partial and self.live else None) or self.best_blank
        return list(best.tokens) if best is not None else []

    def alternatives(self) -> list[list[int]]:
        """The tokens of the next likeliest finished lines after the answer, best first: distinct
        texts, none blank, none more than ALTERNATIVE_MARGIN below the answer, at most
        `alternatives` of them (feed each through an output path of its own)."""
        if self.best is None or not self.alternatives_wanted:
            return []
        floor = self.best.score - ALTERNATIVE_MARGIN
        ranked = sorted(self.finished.values(), key=lambda h: -h.score)
        found = [h.tokens for h in ranked if h is not self.best and h.score >= floor]
        return [list(tokens) for tokens in found[: self.alternatives_wanted]]

    def _may_win(self, score: float) -> bool:
        """Whether a hypothesis of this score may still matter: beat the best finished one or,
        with alternatives wanted, enter the best `1 + alternatives` within the margin."""
        if self.best is None:
            return True
        if not self.alternatives_wanted:
            return score > self.best.score
        floor = self.best.score - ALTERNATIVE_MARGIN
        scores = sorted((h.score for h in self.finished.values()), reverse=True)
        if len(scores) > self.alternatives_wanted:
            floor = max(floor, scores[self.alternatives_wanted])
        return score > floor

    def _finished(self, hyp: Hypothesis, text: str | None = None) -> None:
        if text is None:
            text, _ = self._text(hyp)
        if text.strip():
            if self.alternatives_wanted:
                known = self.finished.get(text)
                if known is None or hyp.score > known.score:
                    self.finished[text] = hyp
            if self.best is None or hyp.score > self.best.score:
                self.best = hyp
        elif self.best_blank is None or hyp.score > self.best_blank.score:
            self.best_blank = hyp

    def _text(self, hyp: Hypothesis) -> tuple[str, bool]:
        """The completion's text so far (after the healed text, cut at the first stop string)
        and whether a stop string ended it."""
        text = self.tokenizer.decode(hyp.tokens)
        forced = self.forced_text
        text = (
            text[len(forced) :]
            if text.startswith(forced)
            else ("" if forced.startswith(text) else text)
        )
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        return (text[:cut], True) if cut >= 0 else (text, False)


class BeamRun:
    """One request's search in the engine: the search, its beams' own K/V, and the beams the next
    step computes."""

    def __init__(self, search: BeamSearch, num_layers: int):
        self.search = search
        self.tails = BeamTails(num_layers)
        self.feed: tuple[list[int], list[int]] | None = None  # (parents, tokens) of the next step

    def start(self, logits: torch.Tensor) -> bool:
        """Take the prompt's next-token logits [V]; False when the search is already over."""
        self.feed = self.search.step(logits[None])
        return self.feed is not None

    def step(self, forward: Callable[[list[int], BeamTails], torch.Tensor]) -> bool:
        """One step: `forward(tokens, tails)` gives the beams' logits [B, V] for their new tokens
        (tails already reordered to the beams' parents); False when the search is over."""
        parents, tokens = self.feed
        self.tails.select(parents)
        self.feed = self.search.step(forward(tokens, self.tails))
        return self.feed is not None

    def answer(self, partial: bool = False) -> list[int]:
        return self.search.answer(partial)

    def alternatives(self) -> list[list[int]]:
        return self.search.alternatives()
