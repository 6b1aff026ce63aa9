"""The scheduler: decides what each engine step does; it never runs the model.

Each step it takes new requests and cancellations; ends superseded, cancelled and expired ones;
admits waiting requests whose blocks fit (prefix-cache hits first acquire shared blocks); and
plans one prefill chunk (interactive completions before warm-ups), then, once that chunk ran,
one decode batch over every decoding sequence (a prompt just completed joins it). A long cold
prompt therefore delays running decodes by at most one chunk, and a warm-up never delays a
completion's prefill.

Fairness: requests that share an `owner` (a connection) take turns with other owners; requests
without one (the CLI, evals, benchmarks) are one owner, served first come first served. Waiting
requests are admitted fewest-in-service owner first, and while another owner has requests
waiting or running, an owner's completions hold at most `owner_block_share` of the KV pool (one
request may take more if it is the owner's only one), so that one client's queue cannot fill the
pool; a lone client is never held back by it. Prefill chunks go round-robin across owners and
a decode batch too full for everyone takes each owner's oldest requests first. Interactive
completions still come before warm-ups everywhere, and preempt them (their own owner's too) for
blocks.

A request the engine can never run is refused with a typed exception (engine.core.request):
EmptyPrompt, ContextExceeded, PoolFull, BadRequest.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.options import EngineOptions
from engine.core.request import PoolFull, TokenBudget, check_request, token_budget
from engine.core.state import RequestState
from engine.core.usage import Counters
from engine.kv.block_allocator import BlockAllocator
from engine.kv.pool import KVPool
from engine.kv.sequence import BlockTable


@dataclass
class PrefillChunk:
    request: RequestState
    start: int  # prompt tokens [start, end) are computed in this step
    end: int

    @property
    def last(self) -> bool:
        """Whether the chunk completes the prompt."""
        return self.end >= len(self.request.request.prompt_ids)


@dataclass
class StepPlan:
    # Requests ended before any model work, in order, with their reason ("cancelled",
    # "superseded", "deadline", "preempted") or the exception that refused them. Their blocks
    # are already released.
    ended: list[tuple[RequestState, str | Exception]] = field(default_factory=list)
    prefill: PrefillChunk | None = None


class Scheduler:
    def __init__(
        self,
        pool: KVPool,
        options: EngineOptions,
        context_length: int,
        prefill_chunk: int,
        counters: Counters,
        prepare: Callable[[RequestState, TokenBudget], None],
    ):
        self.pool = pool
        self.block_size = options.block_size
        self.allocator = BlockAllocator(pool.num_blocks, options.block_size, salt=options.salt)
        self.context_length = context_length  # the model's: prompt, forced text and budget fit it
        self.prefill_chunk = prefill_chunk
        self.max_batch = options.max_batch
        self.prefix_cache = options.prefix_cache
        self.owner_block_limit = max(1, int(pool.num_blocks * options.owner_block_share))
        self.counters = counters
        # Sets up a completion's output (engine.core.output.OutputSetup) once its budget is known,
        # before any block is taken: a setup that fails (a bad seed) leaks nothing.
        self.prepare = prepare
        self.waiting: list[RequestState] = []
        self.running: list[RequestState] = []
        self._turns = itertools.count()
        self._prefill_turns: dict[str, int] = {}  # owner -> when it last had a prefill chunk

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running)

    # -- the plan ------------------------------------------------------------------------------
    def schedule(self, arrivals: list[RequestState], cancels: list[tuple[str, str]]) -> StepPlan:
        plan = StepPlan()
        self._arrive(arrivals, cancels)
        self._end_cancelled(plan.ended)
        self._admit(plan.ended)
        plan.prefill = self._next_prefill()
        return plan

    def decode_batch(self) -> list[RequestState]:
        """The sequences of this decode step: all of them when they fit in `max_batch`, else each
        owner's oldest first (its n-th after every other owner's (n-1)-th), so that one client's
        many requests cannot keep another's out of the batch."""
        decoding = [state for state in self.running if state.decoding]
        if len(decoding) <= self.max_batch:
            return decoding
        seen: Counter = Counter()
        ranked = []
        for state in sorted(decoding, key=lambda state: state.order):
            ranked.append(((seen[state.owner], state.order), state))
            seen[state.owner] += 1
        return [state for _, state in sorted(ranked, key=lambda pair: pair[0])[: self.max_batch]]

    # -- blocks ----------------------------------------------------------------------------------
    def prompt_computed(self, state: RequestState) -> None:
        """The whole prompt's K/V are in the pool: shareable from now on."""
        if self.prefix_cache:
            self.allocator.register(
                state.table.blocks, state.request.prompt_ids, known=state.block_hashes
            )

    def release(self, state: RequestState) -> None:
        """Take a request out of service and free its blocks (again: nothing)."""
        if state in self.waiting:
            self.waiting.remove(state)
        if state in self.running:
            self.running.remove(state)
        if state.table is not None:
            # Whatever was computed stays reusable: a superseded warm-up still warms.
            if self.prefix_cache:
                self.allocator.register(
                    state.table.blocks,
                    state.tokens[: state.computed],
                    partial=True,
                    known=state.block_hashes,
                )
            state.table.free()
            state.table = None

    # -- arrivals and endings --------------------------------------------------------------------
    def _arrive(self, arrivals: list[RequestState], cancels: list[tuple[str, str]]) -> None:
        for state in arrivals:
            self.counters.requests += 1
            if state.request.client is not None:
                for other in self.waiting + self.running:
                    if other.request.client == state.request.client and other.cancel_reason is None:
                        other.cancel_reason = "superseded"
            self.waiting.append(state)
        for request_id, reason in cancels:
            for state in self.waiting + self.running:
                if state.request.id == request_id and state.cancel_reason is None:
                    state.cancel_reason = reason

    def _end_cancelled(self, ended: list) -> None:
        now = time.monotonic()
        for state in list(self.waiting) + list(self.running):
            deadline = state.request.deadline_s
            if (
                state.cancel_reason is None
                and deadline is not None
                and now - state.submitted > deadline
            ):
                state.cancel_reason = "deadline"
            if state.cancel_reason is not None:
                self.counters.cancelled += 1
                self.release(state)
                ended.append((state, state.cancel_reason))

    # -- admission -------------------------------------------------------------------------------
    def _admit(self, ended: list) -> None:
        # Owner -> KV blocks its running completions took; warm-ups do not count: any completion
        # preempts them.
        held = Counter()
        for state in self.running:
            if not state.request.warm_only:
                held[state.owner] += self._blocks(state)
        # Owner -> its requests still waiting.
        waiting = Counter(state.owner for state in self.waiting)
        running = Counter(state.owner for state in self.running)
        still = len(self.waiting)
        for state in self._admission_order():
            waiting[state.owner] -= 1
            still -= 1
            # The share holds only while another owner has requests waiting or running: a lone
            # client may use the whole pool.
            others = still - waiting[state.owner] + len(self.running) - running[state.owner]
            before = len(self.running)
            try:
                admitted = self._try_admit(state, held[state.owner] if others else 0, ended)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone, never the loop
                self._refuse(state)
                ended.append((state, exc))
                continue
            if len(self.running) != before:  # warm-ups were preempted
                running = Counter(r.owner for r in self.running)
            if admitted:
                self.waiting.remove(state)
                self.running.append(state)
                running[state.owner] += 1
                if not state.request.warm_only:
                    held[state.owner] += self._blocks(state)
            else:  # it waits on: the share holds for the owners after it
                waiting[state.owner] += 1
                still += 1

    def _refuse(self, state: RequestState) -> None:
        """Take out a waiting request that cannot be admitted; nothing of it was computed."""
        self.waiting.remove(state)
        if state.table is not None:
            state.table.free()
            state.table = None

    def _admission_order(self) -> list[RequestState]:
        """Completions before warm-ups; then round-robin across owners (an owner's n-th request in
        service, running or waiting, goes after every other owner's (n-1)-th); then arrival."""
        in_service = Counter(state.owner for state in self.running)
        queued: Counter = Counter()
        ranked = []
        for state in sorted(self.waiting, key=lambda state: state.order):
            kind = (state.owner, state.request.warm_only)
            ranked.append(
                (
                    (state.request.warm_only, in_service[state.owner] + queued[kind], state.order),
                    state,
                )
            )
            queued[kind] += 1
        return [state for _, state in sorted(ranked, key=lambda pair: pair[0])]

    def _blocks(self, state: RequestState) -> int:
        return -(-state.room // self.block_size)

    def _try_admit(self, state: RequestState, owner_blocks: int, ended: list) -> bool:
        req, bs = state.request, self.block_size
        prompt = req.prompt_ids
        check_request(req, self.context_length)
        budget = token_budget(req, self.context_length)
        total = budget.total
        needed = -(-total // bs)
        if needed > self.allocator.num_blocks:
            raise PoolFull(
                f"request needs {needed} KV blocks ({total} tokens) "
                f"but the pool has {self.allocator.num_blocks}"
            )
        if owner_blocks and owner_blocks + needed > self.owner_block_limit:
            # Its owner holds its share of the pool: wait until one of its requests ends.
            return False
        if not req.warm_only:
            self.prepare(state, budget)
        # Keep at least the last prompt token to compute: its logits give the first new token.
        shared, cached = [], 0
        if self.prefix_cache:
            shared, cached = self.allocator.match_prefix_partial(
                prompt, max_tokens=len(prompt) - 1, known=state.block_hashes
            )
        fresh = needed - len(shared) + (cached % bs > 0)  # a partial block is copied before writing
        if fresh > self.allocator.available() and not req.warm_only:
            self._preempt_warms(fresh, ended)
        if fresh > self.allocator.available() and cached % bs:
            # The copy of a partly reused block is the one block too many (e.g. a request as
            # large as the pool): recompute those few tokens instead.
            self.allocator.release([shared.pop()])
            cached -= cached % bs
            fresh = needed - len(shared)
        if fresh > self.allocator.available():
            self.allocator.release(shared)  # wait for running requests to finish
            return False
        state.table = BlockTable(self.allocator, self.pool, shared)
        state.table.grow_to(total)
        if cached % bs:
            state.table.prepare_write(cached, cached + 1)  # copy it now, while the block is counted
        state.tokens = list(prompt)
        state.computed = state.cached = cached
        state.room = total
        state.started = time.monotonic()
        self.counters.prompt_tokens += len(prompt)
        self.counters.cache_hit_tokens += state.cached
        return True

    def _preempt_warms(self, wanted: int, ended: list) -> None:
        for state in [state for state in self.running if state.request.warm_only]:
            if self.allocator.available() >= wanted:
                return
            self.release(state)
            ended.append((state, "preempted"))

    # -- prefill turns ---------------------------------------------------------------------------
    def _next_prefill(self) -> PrefillChunk | None:
        """Completions before warm-ups; among them, round-robin across owners: the owner whose
        last chunk is longest ago (or never was) goes next, its oldest request first."""
        pending = [state for state in self.running if not state.decoding]
        if not pending:
            return None
        turns = self._prefill_turns
        chosen = min(
            pending,
            key=lambda state: (state.request.warm_only, turns.get(state.owner, -1), state.order),
        )
        turns[chosen.owner] = next(self._turns)
        if len(turns) > 4 * len(self.running) + 64:  # forget owners that have nothing running
            live = {state.owner for state in self.running}
            self._prefill_turns = {owner: t for owner, t in turns.items() if owner in live}
        end = min(len(chosen.request.prompt_ids), chosen.computed + self.prefill_chunk)
        return PrefillChunk(chosen, chosen.computed, end)
