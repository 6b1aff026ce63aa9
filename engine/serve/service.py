"""The completion service behind every front of the engine: the daemon's msgpack socket and the
OpenAI-compatible endpoint both go through it, and neither knows the other.

It builds a prompt from `CompletionParams` (a few at a time, bounded in time and memory by the
model's context rather than by the texts' sizes), checks it against the context (once, with
`engine.core.request.check_prompt`), submits the engine request and hands its events to the
event loop, cancels, and answers stats, health and the model's facts. A refused request raises a
typed `RequestRefused` carrying its `ErrorCode`, or ValueError/TypeError for malformed input;
each front says on its own wire what a code means. Transports, their limits and the lifecycle
of the process are the fronts' and the daemon's.
"""

from __future__ import annotations

import asyncio
import os
import time
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from engine.core.request import ContextExceeded, Event, Request, check_prompt
from engine.decoding.token_healing import token_healer
from engine.ipc.protocol import CompletionParams
from engine.models import display_name
from engine.prompts.layout import (
    MAX_PROMPT_TOKENS,
    UNBOUNDED_TEXT_BYTES,
    ContextChunk,
    layout_completion_prompt,
    max_token_bytes,
    plain_prompt_ids,
    prompt_budget,
    supported_fim_orders,
    uses_repo_context,
    utf8_len,
)

if TYPE_CHECKING:
    from engine.core.engine import Engine

PROMPT_BUILDERS = 2  # prompts tokenized at once, all fronts together

# A completion prompt keeps at least this share of the model's context (or of the prompt cap, if
# smaller): a max_tokens that would leave less is refused, not met by cutting the user's code
# down to a few tokens.
MIN_PROMPT_SHARE = 4


class Prompt(NamedTuple):
    ids: list[int]
    forced_text: str = ""  # what the first new tokens must write (token healing); not released


class CompletionService:
    """One engine, served to any number of fronts. `draining` and `last_activity` are shared:
    a front refuses new work while draining and touches the service when a client is active."""

    def __init__(
        self,
        engine: Engine,
        model_dir: Path,
        max_prompt_tokens: int = MAX_PROMPT_TOKENS,
        prompt_builders: int = PROMPT_BUILDERS,
    ):
        self.engine = engine
        self.model_dir = Path(model_dir)
        self.max_prompt_tokens = max_prompt_tokens
        self._builders = asyncio.Semaphore(prompt_builders)
        self.started = time.monotonic()
        self.last_activity = time.monotonic()
        self.draining = False

    # -- lifecycle ------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """The one-time work of the first completion now: the tokenizer's scans (token healing's
        vocabulary, the prompt-length bound of engine.prompts.layout) and the model folder's FIM
        conventions."""
        token_healer(self.engine.tokenizer)
        max_token_bytes(self.engine.tokenizer)
        _ = self.fim_orders, self.repo_context

    def start(self) -> None:
        self.engine.start_thread()

    def stop(self) -> None:
        self.engine.stop()

    def touch(self) -> None:
        """A client was active now: the daemon's idle time counts from here."""
        self.last_activity = time.monotonic()

    @property
    def alive(self) -> bool:
        return self.engine.alive

    # -- the model's facts ----------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return display_name(self.model_dir)

    @property
    def context_length(self) -> int:
        return self.engine.model.config.max_position_embeddings

    @cached_property
    def fim_orders(self) -> tuple[str, ...]:
        return supported_fim_orders(self.model_dir)

    @cached_property
    def repo_context(self) -> bool:
        return uses_repo_context(self.model_dir)

    @property
    def least_prompt_tokens(self) -> int:
        return min(self.max_prompt_tokens, self.context_length // MIN_PROMPT_SHARE)

    @property
    def max_completion_tokens(self) -> int:
        """The largest max_tokens a FIM completion may ask for (see `_fim_budget`)."""
        return self.context_length - self.least_prompt_tokens - 1

    # -- prompts --------------------------------------------------------------------------------
    async def prepare(self, p: CompletionParams, whole_budget: bool = False) -> Prompt:
        """The checked prompt of `p`. With `whole_budget` the prompt and all of max_tokens must
        fit the context (the OpenAI contract); without, a budget past the room left ends the
        completion at the context's end."""
        prompt = Prompt(*await self.build_prompt(p))
        check_prompt(len(prompt.ids), self.context_length, p.max_tokens if whole_budget else None)
        return prompt

    def prepare_ids(self, ids: list, max_tokens: int) -> Prompt:
        """A prompt given as token ids, checked as `prepare` checks one with `whole_budget`: its
        length first, so that a huge list is refused before it is scanned."""
        check_prompt(len(ids), self.context_length, max_tokens)
        vocab = self.engine.tokenizer.vocab_size
        if not all(0 <= t < vocab for t in ids):
            raise ValueError(f"token ids must be integers in [0, {vocab})")
        return Prompt(list(ids))

    async def build_prompt(self, p: CompletionParams) -> tuple[list[int], str]:
        """`_build_prompt` off the event loop, at most `prompt_builders` at a time, so that a few
        clients' large prompts leave cores for the engine and a turn for everyone else. A build's
        slot is given back when the build ends, not when the task awaiting it does: a task
        cancelled mid-build (its peer left) must not let another build start beside it."""
        await self._builders.acquire()
        try:
            build = asyncio.get_running_loop().run_in_executor(None, self._build_prompt, p)
        except BaseException:
            self._builders.release()
            raise
        build.add_done_callback(lambda _: self._builders.release())
        return await asyncio.shield(build)

    def _build_prompt(self, p: CompletionParams) -> tuple[list[int], str]:
        """The prompt's ids, and the text its first tokens must write (token healing). Bounded in
        time and memory by the model's context, not by the texts' sizes. Raises ContextExceeded
        for a prompt that cannot fit, found by its size before tokenizing where that tells, and
        ValueError for other bad input."""
        tokenizer = self.engine.tokenizer
        context = self.context_length
        if p.prompt is not None:
            ids = plain_prompt_ids(tokenizer, p.prompt, context - 1)  # one position for the reply
            if ids is not None:
                return ids, ""
            if max_token_bytes(tokenizer) is None and utf8_len(p.prompt) > UNBOUNDED_TEXT_BYTES:
                raise ContextExceeded(
                    f"the prompt is over {UNBOUNDED_TEXT_BYTES} bytes, the most this engine "
                    "tokenizes with this model's tokenizer (whose token count a text's size does "
                    "not bound)"
                )
            raise ContextExceeded(
                f"the prompt has more than {context - 1} tokens; this model's maximum context "
                f"length is {context} tokens, one of them for the reply"
            )
        order = p.fim_order
        if order == "auto":
            order = "spm" if "spm" in self.fim_orders else "psm"
        return layout_completion_prompt(
            tokenizer,
            p.prefix,
            p.suffix,
            [ContextChunk(c["path"], c["text"]) for c in p.chunks],
            p.path,
            order,
            max_prompt_tokens=self._fim_budget(p.max_tokens),
            repo_context=self.repo_context,
            heal=True,
        )

    def _fim_budget(self, max_tokens: int) -> int:
        """Tokens a completion prompt may take; a max_tokens that leaves less than the least
        prompt is refused: cutting the code around the cursor to a few tokens helps nobody."""
        context = self.context_length
        budget = prompt_budget(context, max_tokens, self.max_prompt_tokens)
        least = self.least_prompt_tokens
        if budget < least:
            raise ContextExceeded(
                f"max_tokens={max_tokens} leaves too little of this model's {context}-token "
                "context for the code around the cursor: a completion may ask for at most "
                f"{self.max_completion_tokens}, so that a {least}-token prompt fits"
            )
        return budget

    # -- requests -------------------------------------------------------------------------------
    @staticmethod
    def make_request(
        p: CompletionParams,
        prompt: Prompt,
        *,
        request_id: str,
        owner: str,
        client: str | None = None,
        warm: bool = False,
        stop_at_eos: bool = True,
    ) -> Request:
        """The engine request for `p` over `prompt`. `owner` is whom the engine shares itself
        fairly with; `client` a key whose newer request supersedes this one."""
        return Request(
            prompt.ids,
            max_tokens=p.max_tokens,
            temperature=float(p.temperature),
            top_p=float(p.top_p),
            seed=p.seed,
            stop=p.stop,
            stop_at_eos=stop_at_eos,
            warm_only=warm,
            client=client,
            owner=owner,
            deadline_s=None if p.deadline_ms is None else p.deadline_ms / 1000.0,
            forced_text=prompt.forced_text,
            beams=p.beams,
            n=p.n,
            id=request_id,
        )

    def submit(self, request: Request) -> asyncio.Queue[Event]:
        """Submit `request` to the engine; its events arrive on the returned queue in the running
        loop (the engine's thread only ever queues them). Unbounded, yet it stays short: a front
        drains it as fast as the loop runs."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        self.engine.submit(request, lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
        return events

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """End the request (a no-op for one that has ended); its last event says so."""
        self.engine.cancel(request_id, reason)

    # -- answers --------------------------------------------------------------------------------
    def stats(self) -> dict:
        return self.engine.stats()

    def health(self) -> dict:
        return dict(
            ok=not self.draining and self.alive,
            pid=os.getpid(),
            uptime_s=round(time.monotonic() - self.started, 3),
        )

    def model_info(self) -> dict:
        model = self.engine.model
        cfg = model.config
        return dict(
            name=self.model_name,
            architecture=cfg.architecture,
            layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            experts=cfg.num_experts,
            experts_per_token=cfg.num_experts_per_tok,
            vocab_size=cfg.vocab_size,
            max_context=cfg.max_position_embeddings,
            fim_orders=list(self.fim_orders),
            max_completion_tokens=self.max_completion_tokens,
            dtype=str(model.dtype).removeprefix("torch."),
            device=str(model.device),
            kv_block_size=self.engine.block_size,
        )
