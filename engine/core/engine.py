"""The engine: one thread owns the model and the KV pool and serves every request.

`Engine` is the loop: it takes requests and cancellations from any thread (its inbox), asks the
scheduler (engine.core.scheduler) for each step's plan, has the runner (engine.core.runner)
execute it on the model, turns the logits into tokens (engine.decoding.sampling) and the tokens
into text (engine.core.output), and delivers a request's events through its callback, from the
engine thread. The daemon, `wd-engine generate`, the eval and the benchmarks all generate
through it: `submit` and a thread (`start_thread`), or `run_until_idle` / `complete` to drive it
synchronously.

Two decoding strategies run beside plain decode steps, where the lean CPU path applies:
- a greedy request that asks for beams (`Request.beams`, a single line at the cursor) is searched
  with a beam (engine.decoding.beam_search): one forward of its beams' rows a step, their own K/V
  beside the prompt's shared blocks, the chosen text released at the end (and, asked for
  `Request.n` > 1, other lines the search finished, each through an output path of its own, in
  the final event);
- a lone greedy sequence decodes speculatively (engine.decoding.speculative): a prompt-lookup
  draft verified by one forward, its accepted tokens released one by one as plain steps would.

Requests finish with an event; text arrives as delta events; an error event carries an
`ErrorCode` (a refusal's own, else ENGINE_ERROR).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

import torch

from engine.core.options import EngineOptions
from engine.core.output import OutputAssembler, OutputSetup
from engine.core.request import (
    Completion,
    Event,
    Request,
    RequestRefused,
    token_budget,
)
from engine.core.runner import ModelRunner
from engine.core.scheduler import PrefillChunk, Scheduler
from engine.core.state import RequestState
from engine.core.usage import Counters, request_usage
from engine.decoding.beam_search import BeamRun, BeamSearch
from engine.decoding.sampling import GREEDY_BELOW, TokenChooser
from engine.decoding.speculative import Speculation
from engine.ipc.protocol import ErrorCode
from engine.loading.tokenizer import Tokenizer
from engine.model.qwen3_moe import LEAN_MAX_ROWS, Qwen3MoeModel

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self, model: Qwen3MoeModel, tokenizer: Tokenizer, options: EngineOptions | None = None
    ):
        options = options or EngineOptions()
        cfg = model.config
        self.model = model
        self.tokenizer = tokenizer
        self.options = options
        # Ids past the tokenizer's vocabulary (a checkpoint's padded embedding rows) never sample.
        vocab_limit = tokenizer.vocab_size if tokenizer.vocab_size < cfg.vocab_size else None
        self.chooser = TokenChooser(tokenizer.unsampled_ids, vocab_limit)
        # Draft tokens greedy decoding never writes are cut off; an ending token ends a draft.
        never = set(tokenizer.unsampled_ids) | set(
            range(vocab_limit or cfg.vocab_size, cfg.vocab_size)
        )
        self.speculation = Speculation(
            frozenset(never), frozenset(tokenizer.eos_ids), LEAN_MAX_ROWS
        )
        self.runner = ModelRunner(model, options, vocab_limit)
        # Drafts are verified by the lean rows forward: where it cannot run, none is made.
        self.speculates = options.speculative and self.runner.lean_rows_apply()
        self.counters = Counters()
        self.scheduler = Scheduler(
            self.runner.pool,
            options,
            cfg.max_position_embeddings,
            options.chunk_for(model.device),
            self.counters,
            OutputSetup(tokenizer, model.device),
        )
        self._lock = threading.Condition()
        self._inbox: list[RequestState] = []
        self._cancels: list[tuple[str, str]] = []
        self._order = itertools.count()
        self._stop = False
        self._thread: threading.Thread | None = None

    @classmethod
    def for_one_request(
        cls, model: Qwen3MoeModel, tokenizer: Tokenizer, request: Request, **choices
    ) -> Engine:
        """An engine for one request (`wd-engine generate`, the expert-parallel entry point): a
        pool that holds just it, and no CUDA graphs, whose capture takes longer than one request
        gains. `choices`: other EngineOptions."""
        choices.setdefault("cuda_graphs", False)
        budget = token_budget(request, model.config.max_position_embeddings)
        return cls(model, tokenizer, EngineOptions.holding(budget.total, **choices))

    @property
    def block_size(self) -> int:
        return self.options.block_size

    # -- public, any thread ---------------------------------------------------------------------
    def submit(self, request: Request, on_event: Callable[[Event], None]) -> str:
        state = RequestState(request, on_event, next(self._order), time.monotonic())
        with self._lock:
            self._inbox.append(state)
            self._lock.notify()
        return request.id

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        with self._lock:
            self._cancels.append((request_id, reason))
            self._lock.notify()

    def stats(self) -> dict:
        blocks = self.scheduler.allocator.stats()
        pool = self.runner.pool
        return dict(
            self.counters.as_dict(),
            draft_tokens=self.speculation.drafted,
            draft_accepted=self.speculation.accepted,
            blocks_total=blocks.blocks_total,
            blocks_used=blocks.blocks_used,
            blocks_free=blocks.blocks_free,
            blocks_evictable=blocks.blocks_evictable,
            evictions=blocks.evictions,
            block_size=self.options.block_size,
            kv_bytes_per_token=pool.bytes_per_token(),
            prefix_cache=self.options.prefix_cache,
            speculative=self.options.speculative,
            kv_format="fp8_e4m3" if pool.fp8 else str(self.model.dtype).removeprefix("torch."),
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
        )

    def run_forever(self) -> None:
        """The engine thread's loop; returns after `stop()`."""
        while True:
            with self._lock:
                while not (self._stop or self._inbox or self._cancels or not self.scheduler.idle):
                    self._lock.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception:  # noqa: BLE001 - last line of defence: fail what runs, keep serving
                log.exception("engine step failed outside the model")
                for state in self.scheduler.running + self.scheduler.waiting:
                    self._fail(state, "engine error: internal failure, see the engine log")

    @property
    def alive(self) -> bool:
        return self._thread is None or self._thread.is_alive()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()

    def start_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self.run_forever, name="wd-engine-loop", daemon=True)
        thread.start()
        self._thread = thread
        return thread

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Synchronous driving, for tests and one-shot tools."""
        for _ in range(max_steps):
            self.step()
            if not (self._inbox or self._cancels or not self.scheduler.idle):
                return

    def complete(
        self, request: Request, on_event: Callable[[Event], None] | None = None
    ) -> Completion:
        """Submit one request and run until idle: its events gathered (each also passed to
        `on_event`, e.g. to stream the text)."""
        result = Completion(request.id)

        def gather(event: Event) -> None:
            result.add(event)
            if on_event is not None:
                on_event(event)

        self.submit(request, gather)
        self.run_until_idle()
        return result

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> None:
        with self._lock:
            arrivals, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        plan = self.scheduler.schedule(arrivals, cancels)
        for state, why in plan.ended:
            if isinstance(why, Exception):
                self._refuse(state, why)
            else:
                self._end(state, why)
        if plan.prefill is not None:
            self._guarded([plan.prefill.request], self._prefill, plan.prefill)
        decoding = self.scheduler.decode_batch()  # after the prefill: a finished prompt joins
        if decoding:
            self._guarded(decoding, self._decode, decoding)

    def _guarded(self, states: list[RequestState], fn, arg) -> None:
        """A failure inside the model ends the requests involved, never the loop."""
        try:
            fn(arg)
        except Exception as exc:  # noqa: BLE001 - reported to the client, logged, loop goes on
            log.exception("engine step failed")
            for state in states:
                if state in self.scheduler.running:
                    self._fail(state, f"engine error: {type(exc).__name__}: {exc}")

    def _prefill(self, chunk: PrefillChunk) -> None:
        state = chunk.request
        t0 = time.monotonic()
        logits, greedy = self.runner.prefill(state, chunk.start, chunk.end)
        state.computed = chunk.end
        now = time.monotonic()
        state.prefill_s += now - t0
        if not chunk.last:
            return
        state.prompt_done = now
        self.scheduler.prompt_computed(state)
        if state.request.warm_only:
            self._finish(state, "warmed")
            return
        if state.request.beams > 1 and self._start_beam_search(state, logits):
            return
        self._accept(state, logits, first=True, device_greedy=greedy)

    def _decode(self, batch: list[RequestState]) -> None:
        plain = []
        for state in batch:
            if state.beam is not None:
                self._beam_step(state)
            else:
                plain.append(state)
        if not plain:
            return
        if len(plain) == 1 and self._speculate(plain[0]):
            return
        logits, greedy = self.runner.decode(plain)
        for i, state in enumerate(plain):
            state.computed += 1
            self._accept(state, logits[i], device_greedy=greedy[i] if greedy is not None else None)

    def _accept(
        self,
        state: RequestState,
        logits: torch.Tensor,
        first: bool = False,
        device_greedy: int | torch.Tensor | None = None,
    ) -> int:
        """The next token from `logits` [V] (returned), its text out as a delta, the end where it
        ends."""
        req = state.request
        token = self.chooser.choose(
            logits, req.temperature, req.top_p, state.generator, state.forcing, device_greedy
        )
        if first:
            state.first_token = time.monotonic()
            if req.return_logits:  # a copy: graph outputs are reused
                state.first_logits = self.chooser.visible(logits).clone()
        self._push(state, token)
        if state.output.finished:
            self.counters.completed += 1
            self._finish(state, state.output.finish_reason)
        return token

    def _push(self, state: RequestState, token: int) -> None:
        delta = state.output.push(token)
        state.tokens.append(token)
        if delta:
            self._emit(state, Event(state.request.id, "delta", text=delta))

    # -- decoding strategies ----------------------------------------------------------------------
    def _speculate(self, state: RequestState) -> bool:
        """One speculative step for a lone sequence; False (nothing done) where it does not apply
        (switched off, no lean rows forward, sampling, healed text still to write, no draft)."""
        req, output = state.request, state.output
        if not (self.speculates and self.speculation.applies(req.temperature, state.forcing)):
            return False
        start = state.computed
        room = min(state.room - start, output.max_tokens - output.completion_tokens)

        def verify(rows: list[int]) -> torch.Tensor | None:
            return self.runner.verify(state, rows)

        def accept(row: int, logits: torch.Tensor) -> int | None:
            state.computed = start + row + 1  # the rows up to this one had the right inputs
            token = self._accept(state, logits)
            return None if output.finished else token

        return self.speculation.step(state.tokens, room, req.stop_at_eos, verify, accept) > 0

    def _start_beam_search(self, state: RequestState, logits: torch.Tensor) -> bool:
        """Begin a beam search from the prompt's logits; False (greedy instead) where it does not
        apply: sampling, or no lean CPU path for the beams (CUDA graphs, an fp8 KV pool)."""
        req = state.request
        if req.temperature >= GREEDY_BELOW or not self.runner.lean_rows_apply():
            return False
        search = BeamSearch(
            self.tokenizer,
            req.beams,
            state.output.max_tokens,
            req.stop,
            req.stop_at_eos,
            req.forced_text,
            self.chooser,
            alternatives=req.n - 1,
        )
        state.first_logits = logits.clone() if req.return_logits else None
        state.beam = BeamRun(search, self.model.config.num_layers)
        if not state.beam.start(logits):
            self._end_beam_search(state)
        return True

    def _beam_step(self, state: RequestState) -> None:
        def forward(tokens, tails):
            return self.runner.beam_step(state, tokens, tails)

        if not state.beam.step(forward):
            self._end_beam_search(state)

    def _end_beam_search(self, state: RequestState) -> None:
        """Release the chosen hypothesis through the output path (stops, healed text, budget as
        for greedy); the beams' own K/V were never in the pool, so only the prompt is cached."""
        self._release_beam_answer(state, state.beam.answer())
        self.counters.completed += 1
        self._finish(state, state.output.finish_reason or "eos")

    def _release_beam_answer(self, state: RequestState, tokens: list[int]) -> None:
        run, state.beam = state.beam, None
        state.first_token = time.monotonic()  # the first text the client sees
        for token in tokens:
            self._push(state, token)
            if state.output.finished:
                break
        state.alternative_tokens = run.alternatives()

    def _alternative_texts(self, state: RequestState) -> list[str]:
        """The texts of a search's other lines, as the answer's output path would write them
        (stops, healed text, budget), without the answer's text, blank or repeated ones."""
        req, texts = state.request, []
        seen = {state.output.text}
        for tokens in state.alternative_tokens:
            output = OutputAssembler(
                self.tokenizer,
                state.output.max_tokens,
                req.stop,
                req.stop_at_eos,
                skip_text=req.forced_text,
            )
            text = ""
            for token in tokens:
                text += output.push(token)
                if output.finished:
                    break
            text += output.finish("eos")
            if text.strip() and text not in seen:
                seen.add(text)
                texts.append(text)
        return texts

    # -- endings ----------------------------------------------------------------------------------
    def _end(self, state: RequestState, reason: str) -> None:
        """A request the scheduler ended (cancelled, superseded, past its deadline, preempted)."""
        if state.beam is not None and reason == "deadline":  # greedy's would end with what it has
            self._release_beam_answer(state, state.beam.answer(partial=True))
        self._finish(state, reason)

    def _finish(self, state: RequestState, reason: str) -> None:
        if state.output is not None:
            tail = state.output.finish(reason)
            if tail:
                self._emit(state, Event(state.request.id, "delta", text=tail))
        self._release(state)
        usage = request_usage(state, time.monotonic())
        reason = (
            state.output.finish_reason if state.output and state.output.finish_reason else reason
        )
        token_ids = list(state.output.token_ids) if state.output else None
        done = Event(
            state.request.id,
            "done",
            finish_reason=reason,
            usage=usage,
            logits=state.first_logits,
            token_ids=token_ids,
            alternatives=self._alternative_texts(state) if state.alternative_tokens else None,
        )
        self._emit(state, done)

    def _refuse(self, state: RequestState, exc: Exception) -> None:
        """A waiting request that cannot be admitted: only the engine's own refusals carry their
        code, any other exception is the engine's error."""
        if not isinstance(exc, RequestRefused):
            log.exception("request %s could not be admitted", state.request.id, exc_info=exc)
        code = exc.code if isinstance(exc, RequestRefused) else ErrorCode.ENGINE_ERROR
        self._emit(state, Event(state.request.id, "error", error=str(exc), code=code))
        self.counters.failed += 1

    def _fail(self, state: RequestState, message: str) -> None:
        self._release(state)
        self.counters.failed += 1
        self._emit(
            state, Event(state.request.id, "error", error=message, code=ErrorCode.ENGINE_ERROR)
        )

    def _release(self, state: RequestState) -> None:
        self.scheduler.release(state)

    def _emit(self, state: RequestState, event: Event) -> None:
        try:
            state.on_event(event)
        except Exception:  # noqa: BLE001 - a broken client callback must not stop the engine
            log.exception("event callback failed for request %s", state.request.id)
