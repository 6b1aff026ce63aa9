"""Single-sequence generation: prefill, then decode with a KV cache, streaming text deltas."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.core.output import OutputAssembler
from engine.decoding.beam_search import BeamSearch, BeamTails
from engine.decoding.sampling import GREEDY_BELOW, forbid, sample
from engine.decoding.token_healing import forcing_for
from engine.ipc.protocol import MAX_BEAMS
from engine.loading.tokenizer import Tokenizer
from engine.model.qwen3_moe import Qwen3MoeModel


class PromptTooLong(ValueError):
    """The prompt (plus room for one new token) exceeds the model's context."""


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None  # "stop" (stop string), "eos", "length"
    prefill_s: float = 0.0
    first_token_s: float = 0.0  # from the call to the first released text or the end
    decode_s: float = 0.0
    token_ids: list[int] = field(default_factory=list)  # the forced tokens, then the completion's
    forced_tokens: int = 0  # tokens that wrote the healed text (engine.decoding.token_healing)

    @property
    def decode_tokens_per_s(self) -> float:
        steps = max(self.completion_tokens + self.forced_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0


class GenerationStream:
    """Iterate for text deltas; `stats` and `text` are complete once iteration ends."""

    def __init__(
        self,
        model: Qwen3MoeModel,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[str] | tuple[str, ...] = (),
        stop_at_eos: bool = True,
        forced_text: str = "",
        beams: int = 1,
    ):
        if not prompt_ids:
            raise ValueError("empty prompt: at least one token is needed")
        if not 1 <= beams <= MAX_BEAMS:
            raise ValueError(f"beams must be within 1..{MAX_BEAMS}, got {beams}")
        limit = model.config.max_position_embeddings
        if len(prompt_ids) >= limit:
            raise PromptTooLong(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {limit}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_ids = list(prompt_ids)
        # Room for the tokens that write the forced text (at most one per byte) on top of the budget.
        self.forced_room = min(len(forced_text.encode()), limit - len(prompt_ids))
        self.max_tokens = min(max_tokens, limit - len(prompt_ids) - self.forced_room)
        self.temperature = temperature
        self.top_p = top_p
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator(device=model.device).manual_seed(seed)
        # forced_text: the first tokens must write it, and it is not released (token healing).
        self.output = OutputAssembler(
            tokenizer, self.max_tokens, stop, stop_at_eos, skip_text=forced_text
        )
        self.forcing = forcing_for(tokenizer, forced_text)
        # beams > 1: beam search (engine.decoding.beam_search) where greedy and the lean CPU path apply;
        # the text comes out at the end, through the same output path.
        self.search = None
        if beams > 1 and temperature < GREEDY_BELOW and model.lone_path_applies():
            self.search = BeamSearch(
                tokenizer, beams, self.max_tokens, stop, stop_at_eos, forced_text
            )
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.text = ""

    def __iter__(self):
        started = time.perf_counter()
        for delta in self._deltas():
            if delta:
                if not self.text:
                    self.stats.first_token_s = time.perf_counter() - started
                self.text += delta
                yield delta
        if not self.stats.first_token_s:
            self.stats.first_token_s = time.perf_counter() - started

    def _sample(self, logits: torch.Tensor) -> int:
        logits = forbid(logits, self.tokenizer.unsampled_ids)
        if self.forcing is not None and self.forcing.active:
            logits = self.forcing.mask(logits)
        token = int(sample(logits, self.temperature, self.top_p, self.generator))
        if self.forcing is not None and self.forcing.active:
            self.forcing.advance(token)
        return token

    def _deltas(self):
        model, stats = self.model, self.stats
        if self.max_tokens <= 0:
            stats.finish_reason = "length"
            return
        device = model.device
        cache = model.new_cache(
            1, capacity=len(self.prompt_ids) + self.forced_room + self.max_tokens
        )
        tokens = torch.tensor([self.prompt_ids], device=device)
        positions = torch.arange(len(self.prompt_ids), device=device)[None]
        t0 = time.perf_counter()
        logits = model.forward(tokens, positions, cache, last_only=True)[:, -1]
        position = len(self.prompt_ids)
        out = self.output
        stats.prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.search is not None:  # the search is the decode time; its text comes out at the end
            for token in self._beam_search(logits, cache, position):
                yield out.push(token)
                if out.finished:
                    break
            if not out.finished:  # the chosen hypothesis ended with an ending token
                yield out.finish("eos")
        else:
            next_id = self._sample(logits)
            while True:
                yield out.push(next_id)
                if out.finished:
                    break
                step = torch.tensor([[next_id]], device=device)
                logits = model.forward(step, torch.tensor([[position]], device=device), cache)[
                    :, -1
                ]
                next_id = self._sample(logits)
                position += 1
        stats.decode_s = time.perf_counter() - t0
        stats.finish_reason = out.finish_reason
        stats.token_ids = out.token_ids
        stats.completion_tokens = out.completion_tokens
        stats.forced_tokens = out.forced_tokens

    def _beam_search(self, logits: torch.Tensor, cache, position: int) -> list[int]:
        """The search's chosen tokens (it runs only where the lean path applies)."""
        search, tails = self.search, BeamTails(self.model.config.num_layers)
        feed = search.step(logits)
        while feed is not None:
            parents, tokens = feed
            tails.select(parents)
            logits = self.model.forward_beams(tokens, position + tails.length, cache, tails)
            feed = search.step(logits)
        return search.answer()


def generate(model, tokenizer, prompt_ids, **options) -> GenerationStream:
    """Stream the completion of `prompt_ids` as text deltas (see GenerationStream for options)."""
    return GenerationStream(model, tokenizer, prompt_ids, **options)


def complete(model, tokenizer, prompt_ids, **options) -> tuple[str, GenerationStats]:
    """The whole completion at once, with its stats."""
    stream = GenerationStream(model, tokenizer, prompt_ids, **options)
    for _ in stream:
        pass
    return stream.text, stream.stats
