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
  beside the prompt's shared blocks, the chosen text released at the end;
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
from engine.core.output import OutputSetup
from engine.core.request import (
    Completion,
    Event,
    Request,
    RequestRefused,
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
from engine.model.qwen3_moe import LONE_MAX_ROWS, Qwen3MoeModel

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
            frozenset(never), frozenset(tokenizer.eos_ids), LONE_MAX_ROWS
        )
        self.runner = ModelRunner(model, options, vocab_limit)
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
        a = self.scheduler.allocator.stats()
        pool = self.runner.pool
        return dict(
            self.counters.as_dict(),
            draft_tokens=self.speculation.drafted,
            draft_accepted=self.speculation.accepted,
            blocks_total=a.blocks_total,
            blocks_used=a.blocks_used,
            blocks_free=a.blocks_free,
            blocks_evictable=a.blocks_evictable,
            evictions=a.evictions,
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
                for a in self.scheduler.running + self.scheduler.waiting:
                    self._fail(a, "engine error: internal failure, see the engine log")

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
        for a, why in plan.ended:
            if isinstance(why, Exception):
                self._refuse(a, why)
            else:
                self._end(a, why)
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
            for a in states:
                if a in self.scheduler.running:
                    self._fail(a, f"engine error: {type(exc).__name__}: {exc}")

    def _prefill(self, chunk: PrefillChunk) -> None:
        a = chunk.request
        t0 = time.monotonic()
        logits, greedy = self.runner.prefill(a, chunk.start, chunk.end)
        a.computed = chunk.end
        a.prefill_s += time.monotonic() - t0
        if not chunk.last:
            return
        self.scheduler.prompt_computed(a)
        if a.request.warm_only:
            self._finish(a, "warmed")
            return
        if a.request.beams > 1 and self._start_beam_search(a, logits):
            return
        self._accept(a, logits, first=True, device_greedy=greedy)

    def _decode(self, batch: list[RequestState]) -> None:
        plain = []
        for a in batch:
            if a.beam is not None:
                self._beam_step(a)
            else:
                plain.append(a)
        if not plain:
            return
        if len(plain) == 1 and self._speculate(plain[0]):
            return
        logits, greedy = self.runner.decode(plain)
        for i, a in enumerate(plain):
            a.computed += 1
            self._accept(a, logits[i], device_greedy=greedy[i] if greedy is not None else None)

    def _accept(
        self,
        a: RequestState,
        logits: torch.Tensor,
        first: bool = False,
        device_greedy: int | torch.Tensor | None = None,
    ) -> None:
        """The next token from `logits` [V], its text out as a delta, the end where it ends."""
        req = a.request
        token = self.chooser.choose(
            logits, req.temperature, req.top_p, a.generator, a.forcing, device_greedy
        )
        if first:
            a.first_token = time.monotonic()
            if req.return_logits:  # a copy: graph outputs are reused
                a.first_logits = self.chooser.visible(logits).clone()
        self._push(a, token)
        if a.output.finished:
            self.counters.completed += 1
            self._finish(a, a.output.finish_reason)

    def _push(self, a: RequestState, token: int) -> None:
        delta = a.output.push(token)
        a.tokens.append(token)
        if delta:
            self._emit(a, Event(a.request.id, "delta", text=delta))

    # -- decoding strategies ----------------------------------------------------------------------
    def _speculate(self, a: RequestState) -> bool:
        """One speculative step for a lone sequence; False (nothing done) where it does not apply
        (switched off, CUDA graphs, sampling, healed text still to write, no draft)."""
        if not self.options.speculative or self.runner.graphs is not None:
            return False
        if not self.speculation.applies(a):
            return False
        return self.speculation.step(a, self.runner.verify, self._accept)

    def _start_beam_search(self, a: RequestState, logits: torch.Tensor) -> bool:
        """Begin a beam search from the prompt's logits; False (greedy instead) where it does not
        apply: sampling, or no lean CPU path for the beams (CUDA graphs, an fp8 KV pool)."""
        req = a.request
        if req.temperature >= GREEDY_BELOW or not self.runner.beams_apply():
            return False
        search = BeamSearch(
            self.tokenizer,
            req.beams,
            a.output.max_tokens,
            req.stop,
            req.stop_at_eos,
            req.forced_text,
            self.chooser.vocab_limit,
        )
        a.first_logits = logits.clone() if req.return_logits else None
        a.beam = BeamRun(search, self.model.config.num_layers)
        if not a.beam.start(logits):
            self._end_beam_search(a)
        return True

    def _beam_step(self, a: RequestState) -> None:
        def forward(tokens, tails):
            return self.runner.beam_step(a, tokens, tails)

        if not a.beam.step(forward):
            self._end_beam_search(a)

    def _end_beam_search(self, a: RequestState) -> None:
        """Release the chosen hypothesis through the output path (stops, healed text, budget as
        for greedy); the beams' own K/V were never in the pool, so only the prompt is cached."""
        self._release_beam_answer(a, a.beam.answer())
        self.counters.completed += 1
        self._finish(a, a.output.finish_reason or "eos")

    def _release_beam_answer(self, a: RequestState, tokens: list[int]) -> None:
        a.beam = None
        a.first_token = time.monotonic()  # the first text the client sees
        for token in tokens:
            self._push(a, token)
            if a.output.finished:
                break

    # -- endings ----------------------------------------------------------------------------------
    def _end(self, a: RequestState, reason: str) -> None:
        """A request the scheduler ended (cancelled, superseded, past its deadline, preempted)."""
        if a.beam is not None and reason == "deadline":  # greedy's would end with what it has
            self._release_beam_answer(a, a.beam.answer(partial=True))
        self._finish(a, reason)

    def _finish(self, a: RequestState, reason: str) -> None:
        if a.output is not None:
            tail = a.output.finish(reason)
            if tail:
                self._emit(a, Event(a.request.id, "delta", text=tail))
        self._release(a)
        usage = request_usage(a, time.monotonic())
        reason = a.output.finish_reason if a.output and a.output.finish_reason else reason
        token_ids = list(a.output.token_ids) if a.output else None
        done = Event(
            a.request.id,
            "done",
            finish_reason=reason,
            usage=usage,
            logits=a.first_logits,
            token_ids=token_ids,
        )
        self._emit(a, done)

    def _refuse(self, a: RequestState, exc: Exception) -> None:
        """A waiting request that cannot be admitted: only the engine's own refusals carry their
        code, any other exception is the engine's error."""
        if not isinstance(exc, RequestRefused):
            log.exception("request %s could not be admitted", a.request.id, exc_info=exc)
        code = exc.code if isinstance(exc, RequestRefused) else ErrorCode.ENGINE_ERROR
        self._emit(a, Event(a.request.id, "error", error=str(exc), code=code))
        self.counters.failed += 1

    def _fail(self, a: RequestState, message: str) -> None:
        self._release(a)
        self.counters.failed += 1
        self._emit(a, Event(a.request.id, "error", error=message, code=ErrorCode.ENGINE_ERROR))

    def _release(self, a: RequestState) -> None:
        self.scheduler.release(a)

    def _emit(self, a: RequestState, event: Event) -> None:
        try:
            a.on_event(event)
        except Exception:  # noqa: BLE001 - a broken client callback must not stop the engine
            log.exception("event callback failed for request %s", a.request.id)
