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
        decoding = [a for a in self.running if a.decoding]
        if len(decoding) <= self.max_batch:
            return decoding
        seen: Counter = Counter()
        ranked = []
        for a in sorted(decoding, key=lambda a: a.order):
            ranked.append(((seen[a.owner], a.order), a))
            seen[a.owner] += 1
        return [a for _, a in sorted(ranked, key=lambda pair: pair[0])[: self.max_batch]]

    # -- blocks ----------------------------------------------------------------------------------
    def prompt_computed(self, a: RequestState) -> None:
        """The whole prompt's K/V are in the pool: shareable from now on."""
        if self.prefix_cache:
            self.allocator.register(a.table.blocks, a.request.prompt_ids)

    def release(self, a: RequestState) -> None:
        """Take a request out of service and free its blocks (again: nothing)."""
        if a in self.waiting:
            self.waiting.remove(a)
        if a in self.running:
            self.running.remove(a)
        if a.table is not None:
            # Whatever was computed stays reusable: a superseded warm-up still warms.
            if self.prefix_cache:
                self.allocator.register(a.table.blocks, a.tokens[: a.computed], partial=True)
            a.table.free()
            a.table = None

    # -- arrivals and endings --------------------------------------------------------------------
    def _arrive(self, arrivals: list[RequestState], cancels: list[tuple[str, str]]) -> None:
        for a in arrivals:
            self.counters.requests += 1
            if a.request.client is not None:
                for other in self.waiting + self.running:
                    if other.request.client == a.request.client and other.cancel_reason is None:
                        other.cancel_reason = "superseded"
            self.waiting.append(a)
        for request_id, reason in cancels:
            for a in self.waiting + self.running:
                if a.request.id == request_id and a.cancel_reason is None:
                    a.cancel_reason = reason

    def _end_cancelled(self, ended: list) -> None:
        now = time.monotonic()
        for a in list(self.waiting) + list(self.running):
            deadline = a.request.deadline_s
            if a.cancel_reason is None and deadline is not None and now - a.submitted > deadline:
                a.cancel_reason = "deadline"
            if a.cancel_reason is not None:
                self.counters.cancelled += 1
                self.release(a)
                ended.append((a, a.cancel_reason))

    # -- admission -------------------------------------------------------------------------------
    def _admit(self, ended: list) -> None:
        # Owner -> KV blocks its running completions took; warm-ups do not count: any completion
        # preempts them.
        held = Counter()
        for a in self.running:
            if not a.request.warm_only:
                held[a.owner] += self._blocks(a)
        waiting = Counter(a.owner for a in self.waiting)  # owner -> its requests still waiting
        running = Counter(a.owner for a in self.running)
        still = len(self.waiting)
        for a in self._admission_order():
            waiting[a.owner] -= 1
            still -= 1
            # The share holds only while another owner has requests waiting or running: a lone
            # client may use the whole pool.
            others = still - waiting[a.owner] + len(self.running) - running[a.owner]
            before = len(self.running)
            try:
                admitted = self._try_admit(a, held[a.owner] if others else 0, ended)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone, never the loop
                self._refuse(a)
                ended.append((a, exc))
                continue
            if len(self.running) != before:  # warm-ups were preempted
                running = Counter(r.owner for r in self.running)
            if admitted:
                self.waiting.remove(a)
                self.running.append(a)
                running[a.owner] += 1
                if not a.request.warm_only:
                    held[a.owner] += self._blocks(a)
            else:  # it waits on: the share holds for the owners after it
                waiting[a.owner] += 1
                still += 1

    def _refuse(self, a: RequestState) -> None:
        """Take out a waiting request that cannot be admitted; nothing of it was computed."""
        self.waiting.remove(a)
        if a.table is not None:
            a.table.free()
            a.table = None

    def _admission_order(self) -> list[RequestState]:
        """Completions before warm-ups; then round-robin across owners (an owner's n-th request in
        service, running or waiting, goes after every other owner's (n-1)-th); then arrival."""
        in_service = Counter(a.owner for a in self.running)
        queued: Counter = Counter()
        ranked = []
        for a in sorted(self.waiting, key=lambda a: a.order):
            kind = (a.owner, a.request.warm_only)
            ranked.append(((a.request.warm_only, in_service[a.owner] + queued[kind], a.order), a))
            queued[kind] += 1
        return [a for _, a in sorted(ranked, key=lambda pair: pair[0])]

    def _blocks(self, a: RequestState) -> int:
        return -(-a.room // self.block_size)

    def _try_admit(self, a: RequestState, owner_blocks: int, ended: list) -> bool:
        req, bs = a.request, self.block_size
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
            return (
                False  # its owner holds its share of the pool: wait until one of its requests ends
            )
        if not req.warm_only:
            self.prepare(a, budget)
        # Keep at least the last prompt token to compute: its logits give the first new token.
        shared, cached = [], 0
        if self.prefix_cache:
            shared, cached = self.allocator.match_prefix_partial(prompt, max_tokens=len(prompt) - 1)
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
        a.table = BlockTable(self.allocator, self.pool, shared)
        a.table.grow_to(total)
        if cached % bs:
            a.table.prepare_write(cached, cached + 1)  # copy it now, while the block is counted
        a.tokens = list(prompt)
        a.computed = a.cached = cached
        a.room = total
        a.started = time.monotonic()
        self.counters.prompt_tokens += len(prompt)
        self.counters.cache_hit_tokens += a.cached
        return True

    def _preempt_warms(self, wanted: int, ended: list) -> None:
        for a in [a for a in self.running if a.request.warm_only]:
            if self.allocator.available() >= wanted:
                return
            self.release(a)
            ended.append((a, "preempted"))

    # -- prefill turns ---------------------------------------------------------------------------
    def _next_prefill(self) -> PrefillChunk | None:
        """Completions before warm-ups; among them, round-robin across owners: the owner whose
        last chunk is longest ago (or never was) goes next, its oldest request first."""
        pending = [a for a in self.running if not a.decoding]
        if not pending:
            return None
        turns = self._prefill_turns
        chosen = min(pending, key=lambda a: (a.request.warm_only, turns.get(a.owner, -1), a.order))
        turns[chosen.owner] = next(self._turns)
        if len(turns) > 4 * len(self.running) + 64:  # forget owners that have nothing running
            live = {a.owner for a in self.running}
            self._prefill_turns = {owner: t for owner, t in turns.items() if owner in live}
        end = min(len(chosen.request.prompt_ids), chosen.computed + self.prefill_chunk)
        return PrefillChunk(chosen, chosen.computed, end)
