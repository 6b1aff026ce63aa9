"""The engine loop: one thread owns the model and the KV pool and schedules every request.

Each step: take new requests and cancellations; end superseded, cancelled and expired ones;
admit waiting requests whose blocks fit (prefix-cache hits first acquire shared blocks); run
one prefill chunk (interactive completions before warm-ups) and one batched decode step over
every decoding sequence. A long cold prompt therefore delays running decodes by at most one
chunk, and a warm-up never delays a completion's prefill.

A greedy request that asks for beams (`Request.beams`, a single line at the cursor) is searched
with a beam (engine.decoding.beam_search) on the lean CPU path: one forward of its beams' rows a step,
their own K/V beside the prompt's shared blocks, the chosen text released at the end.

A lone greedy sequence on the CPU decodes speculatively (`speculative`): a prompt-lookup draft
(engine.decoding.prompt_lookup) is verified by one lean forward over [last token] + draft, and the tokens
greedy decoding would have produced go out one by one through the usual output path; K/V
written for rejected draft tokens lie past `computed` and are never read.

Fairness: requests that share an `owner` (a connection) take turns with other owners; requests
without one (the CLI, evals, benchmarks) are one owner, served first come first served. Waiting
requests are admitted fewest-in-service owner first, and while another owner has requests
waiting or running, an owner's completions hold at most `owner_block_share` of the KV pool (one
request may take more if it is the owner's only one), so that one client's queue cannot fill the
pool; a lone client is never held back by it. Prefill chunks go round-robin across owners and
a decode batch too full for everyone takes each owner's oldest requests first. Interactive
completions still come before warm-ups everywhere, and preempt them (their own owner's too) for
blocks.

Requests finish with an event; text arrives as delta events. Events are delivered through the
request's callback, from the engine thread; an error event carries an `engine.ipc.protocol` code.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.core.output import OutputAssembler
from engine.core.request import Event, PoolFull, Request, RequestRefused, check_prompt
from engine.decoding.beam_search import BeamSearch, BeamTails
from engine.decoding.prompt_lookup import draft, writable_prefix
from engine.decoding.sampling import GREEDY_BELOW, forbid, sample
from engine.decoding.token_healing import Forcing, forcing_for
from engine.ipc.protocol import MAX_BEAMS, ErrorCode
from engine.kv.block_allocator import BlockAllocator
from engine.kv.pool import KVPool, PagedBatch
from engine.kv.sequence import BlockTable
from engine.loading.tokenizer import Tokenizer
from engine.model.qwen3_moe import LONE_MAX_ROWS, Qwen3MoeModel

log = logging.getLogger(__name__)

OWNERLESS = "<ownerless>"  # the fairness key of every request without an owner


@dataclass
class _Active:
    request: Request
    on_event: Callable[[Event], None]
    order: int
    submitted: float
    table: BlockTable | None = None
    tokens: list[int] = field(default_factory=list)  # prompt, then generated tokens
    computed: int = 0  # tokens whose K/V are in the pool
    room: int = 0  # tokens the blocks taken at admission hold (prompt, forced text, budget)
    cached: int = 0  # prompt tokens served from the prefix cache
    output: OutputAssembler | None = None
    generator: torch.Generator | None = None
    started: float = 0.0
    first_token: float = 0.0
    prefill_s: float = 0.0
    cancel_reason: str | None = None
    first_logits: torch.Tensor | None = None
    forcing: Forcing | None = None
    beam: _BeamState | None = None

    @property
    def decoding(self) -> bool:
        return self.computed >= len(self.request.prompt_ids)

    @property
    def owner(self) -> str:
        """The fairness key. Requests without an owner share one, so that among them the order
        stays first come, first served (a new one does not take turns with running prefills)."""
        return self.request.owner if self.request.owner is not None else OWNERLESS


@dataclass
class _BeamState:
    search: BeamSearch
    tails: BeamTails
    feed: tuple[list[int], list[int]] | None = None  # (parents, tokens) of the next step


class Engine:
    def __init__(
        self,
        model: Qwen3MoeModel,
        tokenizer: Tokenizer,
        num_blocks: int | None = None,
        block_size: int = 16,
        kv_fp8: bool = False,
        kv_memory_bytes: int = 256 << 20,
        prefill_chunk: int | None = None,
        max_batch: int = 32,
        owner_block_share: float = 0.25,
        salt: str = "",
        prefix_cache: bool = True,
        cuda_graphs: bool = True,
        speculative: bool = True,
    ):
        cfg = model.config
        self.model = model
        self.tokenizer = tokenizer
        self.block_size = block_size
        # Prompt tokens per step: bounds how long a cold prompt stalls running decodes. A GPU
        # chunk of 2048 runs ~3x faster per token than 512 (4K prompt: 208 vs 727 ms, H200).
        if prefill_chunk is None:
            prefill_chunk = 2048 if model.device.type == "cuda" else 512
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1 token, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.max_batch = max_batch
        if num_blocks is None:
            per_token = KVPool(
                cfg.num_layers, 1, 1, cfg.num_kv_heads, cfg.head_dim, model.dtype, "meta", kv_fp8
            )
            num_blocks = max(1, kv_memory_bytes // (per_token.bytes_per_token() * block_size))
        self.pool = KVPool(
            cfg.num_layers,
            num_blocks,
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            model.dtype,
            model.device,
            kv_fp8,
        )
        self.allocator = BlockAllocator(num_blocks, block_size, salt=salt)
        # Blocks one owner may hold: with a quarter, three clients that queue all they can still
        # leave room for a fourth.
        self.owner_block_limit = max(1, int(num_blocks * owner_block_share))
        self.prefix_cache = prefix_cache  # off: every prompt is computed cold (for comparisons)
        # Prompt-lookup drafts for a lone greedy sequence, where the lean CPU path applies.
        self.speculative = speculative
        # Ids past the tokenizer's vocabulary (a checkpoint's padded embedding rows) never sample.
        self.vocab_limit = tokenizer.vocab_size if tokenizer.vocab_size < cfg.vocab_size else None
        # Draft tokens greedy decoding never writes are cut off; an ending token ends a draft.
        never = set(tokenizer.unsampled_ids) | set(
            range(self.vocab_limit or cfg.vocab_size, cfg.vocab_size)
        )
        self._never_drafted, self._ending_ids = frozenset(never), frozenset(tokenizer.eos_ids)
        model.prepare_lone_decode()  # CPU: at engine start, not in the first completion
        self.graphs = None  # CUDA: decode steps and short prompt tails replay captured graphs
        if cuda_graphs and model.device.type == "cuda" and cfg.sliding_window is None:
            from engine.model.cuda_graph import DecodeGraphs

            max_tokens = min(cfg.max_position_embeddings, num_blocks * block_size)
            self.graphs = DecodeGraphs(model, self.pool, max_tokens, self.vocab_limit)
            t0 = time.monotonic()
            self.graphs.capture_all()
            log.info(
                "captured %d decode graphs in %.1f s",
                len(self.graphs.graphs),
                time.monotonic() - t0,
            )
        self._lock = threading.Condition()
        self._inbox: list[_Active] = []
        self._cancels: list[tuple[str, str]] = []
        self._order = itertools.count()
        self._turns = itertools.count()
        self._prefill_turns: dict[str, int] = {}  # owner -> when it last had a prefill chunk
        self.waiting: list[_Active] = []
        self.running: list[_Active] = []
        self.counters = dict(
            requests=0,
            completed=0,
            cancelled=0,
            failed=0,
            prompt_tokens=0,
            cache_hit_tokens=0,
            draft_tokens=0,
            draft_accepted=0,
        )
        self._stop = False

    # -- public, any thread ---------------------------------------------------------------------
    def submit(self, request: Request, on_event: Callable[[Event], None]) -> str:
        active = _Active(request, on_event, next(self._order), time.monotonic())
        with self._lock:
            self._inbox.append(active)
            self._lock.notify()
        return request.id

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        with self._lock:
            self._cancels.append((request_id, reason))
            self._lock.notify()

    def stats(self) -> dict:
        a = self.allocator.stats()
        return dict(
            self.counters,
            blocks_total=a.blocks_total,
            blocks_used=a.blocks_used,
            blocks_free=a.blocks_free,
            blocks_evictable=a.blocks_evictable,
            evictions=a.evictions,
            block_size=self.block_size,
            kv_bytes_per_token=self.pool.bytes_per_token(),
            prefix_cache=self.prefix_cache,
            speculative=self.speculative,
            kv_format="fp8_e4m3" if self.pool.fp8 else str(self.model.dtype).removeprefix("torch."),
            waiting=len(self.waiting),
            running=len(self.running),
        )

    def run_forever(self) -> None:
        """The engine thread's loop; returns after `stop()`."""
        while True:
            with self._lock:
                while not (
                    self._stop or self._inbox or self._cancels or self.waiting or self.running
                ):
                    self._lock.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception:  # noqa: BLE001 - last line of defence: fail what runs, keep serving
                log.exception("engine step failed outside the model")
                for a in list(self.running) + list(self.waiting):
                    self._fail(a, "engine error: internal failure, see the engine log")

    @property
    def alive(self) -> bool:
        thread = getattr(self, "_thread", None)
        return thread is None or thread.is_alive()

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
            if not (self._inbox or self._cancels or self.waiting or self.running):
                return

    # -- the loop body --------------------------------------------------------------------------
    def step(self) -> None:
        self._take_inbox()
        self._end_expired()
        self._admit()
        prefill = self._next_prefill()
        if prefill is not None:
            self._guarded([prefill], self._prefill_chunk, prefill)
        decoding = self._decode_batch()
        if decoding:
            self._guarded(decoding, self._decode_step, decoding)

    def _guarded(self, actives, fn, arg) -> None:
        """A failure inside the model ends the requests involved, never the loop."""
        try:
            fn(arg)
        except Exception as exc:  # noqa: BLE001 - reported to the client, logged, loop goes on
            log.exception("engine step failed")
            for a in actives:
                if a in self.running:
                    self._fail(a, f"engine error: {type(exc).__name__}: {exc}")

    def _take_inbox(self) -> None:
        with self._lock:
            arrivals, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        for a in arrivals:
            self.counters["requests"] += 1
            if a.request.client is not None:
                for other in self.waiting + self.running:
                    if other.request.client == a.request.client and other.cancel_reason is None:
                        other.cancel_reason = "superseded"
            self.waiting.append(a)
        for request_id, reason in cancels:
            for a in self.waiting + self.running:
                if a.request.id == request_id and a.cancel_reason is None:
                    a.cancel_reason = reason

    def _end_expired(self) -> None:
        now = time.monotonic()
        for a in list(self.waiting) + list(self.running):
            deadline = a.request.deadline_s
            if a.cancel_reason is None and deadline is not None and now - a.submitted > deadline:
                a.cancel_reason = "deadline"
            if a.cancel_reason is not None:
                self.counters["cancelled"] += 1
                if (
                    a.beam is not None and a.cancel_reason == "deadline"
                ):  # greedy's would end with what it has
                    self._release_beam_answer(a, a.beam.search.answer(partial=True))
                self._finish(a, a.cancel_reason)

    def _admit(self) -> None:
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
                admitted = self._try_admit(a, held[a.owner] if others else 0)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone, never the loop
                self._refuse(a, exc)
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

    def _refuse(self, a: _Active, exc: Exception) -> None:
        """End a waiting request that cannot be admitted; only the engine's own refusals carry
        their protocol code, any other exception is the engine's error."""
        if not isinstance(exc, RequestRefused):
            log.exception("request %s could not be admitted", a.request.id, exc_info=exc)
        self.waiting.remove(a)
        if a.table is not None:
            a.table.free()
            a.table = None
        code = exc.code if isinstance(exc, RequestRefused) else ErrorCode.ENGINE_ERROR
        self._emit(a, Event(a.request.id, "error", error=str(exc), code=code))
        self.counters["failed"] += 1

    def _admission_order(self) -> list[_Active]:
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

    def _blocks(self, a: _Active) -> int:
        return -(-a.room // self.block_size)

    def _try_admit(self, a: _Active, owner_blocks: int = 0) -> bool:
        req, bs = a.request, self.block_size
        prompt = req.prompt_ids
        limit = self.model.config.max_position_embeddings
        check_prompt(len(prompt), limit)
        # Room for the tokens that write the forced text (at most one per byte) on top of the budget.
        forced = 0 if req.warm_only else min(len(req.forced_text.encode()), limit - len(prompt))
        budget = 0 if req.warm_only else max(min(req.max_tokens, limit - len(prompt) - forced), 0)
        total = len(prompt) + forced + budget
        needed = -(-total // bs)
        if needed > self.allocator.num_blocks:
            raise PoolFull(
                f"request needs {needed} KV blocks ({total} tokens) but the pool has {self.allocator.num_blocks}"
            )
        if owner_blocks and owner_blocks + needed > self.owner_block_limit:
            return (
                False  # its owner holds its share of the pool: wait until one of its requests ends
            )
        if not req.warm_only:  # built before any block is taken, so a bad seed leaks nothing
            a.output = OutputAssembler(
                self.tokenizer, budget, req.stop, req.stop_at_eos, skip_text=req.forced_text
            )
            a.forcing = forcing_for(self.tokenizer, req.forced_text)
            if req.seed is not None:
                a.generator = torch.Generator(device=self.model.device).manual_seed(req.seed)
        # Keep at least the last prompt token to compute: its logits give the first new token.
        shared, cached = [], 0
        if self.prefix_cache:
            shared, cached = self.allocator.match_prefix_partial(prompt, max_tokens=len(prompt) - 1)
        fresh = needed - len(shared) + (cached % bs > 0)  # a partial block is copied before writing
        if fresh > self.allocator.available() and not req.warm_only:
            self._preempt_warms(fresh)
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
        self.counters["prompt_tokens"] += len(prompt)
        self.counters["cache_hit_tokens"] += a.cached
        return True

    def _preempt_warms(self, wanted: int) -> None:
        for a in [a for a in self.running if a.request.warm_only]:
            if self.allocator.available() >= wanted:
                return
            self._finish(a, "preempted")

    def _next_prefill(self) -> _Active | None:
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
        return chosen

    def _decode_batch(self) -> list[_Active]:
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

    # -- model work -----------------------------------------------------------------------------
    def _prefill_chunk(self, a: _Active) -> None:
        prompt = a.request.prompt_ids
        start, end = a.computed, min(len(prompt), a.computed + self.prefill_chunk)
        t0 = time.monotonic()
        a.table.prepare_write(start, end)
        greedy = None
        if self.graphs is not None and end - start <= self.graphs.max_rows:
            # A short tail after a cache hit: one graph replay, a row per new token.
            logits, greedy = self.graphs.run(
                prompt[start:end], list(range(start, end)), [a.table.blocks] * (end - start)
            )
            logits, greedy = logits[None], greedy[-1]
        else:
            device = self.model.device
            tokens = torch.tensor([prompt[start:end]], device=device)
            positions = torch.arange(start, end, device=device)[None]
            view = PagedBatch(self.pool, [a.table.blocks], device)
            logits = self.model.forward(tokens, positions, view, last_only=True)
        a.computed = end
        a.prefill_s += time.monotonic() - t0
        if end < len(prompt):
            return
        if self.prefix_cache:
            self.allocator.register(a.table.blocks, prompt)  # shareable from now on
        if a.request.warm_only:
            self._finish(a, "warmed")
            return
        if a.request.beams > 1 and self._start_beam_search(a, logits[0, -1]):
            return
        self._accept(a, logits[0, -1], first=True, greedy_token=greedy)

    def _decode_step(self, batch: list[_Active]) -> None:
        searching, batch = (
            [a for a in batch if a.beam is not None],
            [a for a in batch if a.beam is None],
        )
        for a in searching:
            self._beam_step(a)
        if not batch:
            return
        if len(batch) == 1 and self._speculative_step(batch[0]):
            return
        device = self.model.device
        for a in batch:
            a.table.prepare_write(a.computed, a.computed + 1)
        if self.graphs is not None and len(batch) <= self.graphs.max_rows:
            logits, greedy = self.graphs.run(
                [a.tokens[-1] for a in batch],
                [a.computed for a in batch],
                [a.table.blocks for a in batch],
            )
            greedy = greedy.tolist()  # one device-to-host copy for the whole batch
        else:
            tokens = torch.tensor([[a.tokens[-1]] for a in batch], device=device)
            positions = torch.tensor([[a.computed] for a in batch], device=device)
            view = PagedBatch(self.pool, [a.table.blocks for a in batch], device)
            logits, greedy = self.model.forward(tokens, positions, view)[:, -1], None
        for i, a in enumerate(batch):
            a.computed += 1
            self._accept(a, logits[i], greedy_token=greedy[i] if greedy is not None else None)

    def _start_beam_search(self, a: _Active, logits: torch.Tensor) -> bool:
        """Begin a beam search from the prompt's logits; False (greedy instead) where it does not
        apply: sampling, CUDA graphs, an fp8 KV pool, or a model off the lean CPU path."""
        req = a.request
        if (
            req.temperature >= GREEDY_BELOW
            or self.graphs is not None
            or self.pool.fp8
            or not self.model.lone_path_applies()
        ):
            return False
        search = BeamSearch(
            self.tokenizer,
            min(req.beams, MAX_BEAMS),
            a.output.max_tokens,
            req.stop,
            req.stop_at_eos,
            req.forced_text,
            self.vocab_limit,
        )
        a.first_logits = logits.clone() if req.return_logits else None
        a.beam = _BeamState(search, BeamTails(self.model.config.num_layers))
        a.beam.feed = search.step(logits[None])
        if a.beam.feed is None:
            self._end_beam_search(a)
        return True

    def _beam_step(self, a: _Active) -> None:
        state = a.beam
        parents, tokens = state.feed
        state.tails.select(parents)
        view = PagedBatch(self.pool, [a.table.blocks], self.model.device)
        logits = self.model.forward_beams(
            tokens, a.computed + state.tails.length, view, state.tails
        )
        state.feed = state.search.step(logits)
        if state.feed is None:
            self._end_beam_search(a)

    def _end_beam_search(self, a: _Active) -> None:
        """Release the chosen hypothesis through the output path (stops, healed text, budget as
        for greedy); the beams' own K/V were never in the pool, so only the prompt is cached."""
        self._release_beam_answer(a, a.beam.search.answer())
        self.counters["completed"] += 1
        self._finish(a, a.output.finish_reason or "eos")

    def _release_beam_answer(self, a: _Active, tokens: list[int]) -> None:
        a.beam = None
        a.first_token = time.monotonic()  # the first text the client sees
        for token in tokens:
            delta = a.output.push(token)
            a.tokens.append(token)
            if delta:
                self._emit(a, Event(a.request.id, "delta", text=delta))
            if a.output.finished:
                break

    def _speculative_step(self, a: _Active) -> bool:
        """One verify forward of [last token] + a prompt-lookup draft; False (nothing done) where
        speculation does not apply. Token by token, exactly as plain greedy steps would: row j's
        logits give the next token through `_accept`; the next row counts only if its input, the
        draft's token j, is that token. `computed` grows by the rows whose input was right, so
        K/V of rejected rows (past it) are never read, nor registered in the prefix cache."""
        req = a.request
        if (
            not self.speculative
            or self.graphs is not None
            or req.temperature >= GREEDY_BELOW
            or (a.forcing is not None and a.forcing.active)
        ):
            return False
        start = a.computed
        # Within the blocks taken at admission, and no more than the output can still take
        # (the rows' tokens plus the bonus token).
        remaining = a.output.max_tokens - a.output.completion_tokens
        proposal = draft(a.tokens, min(LONE_MAX_ROWS - 1, a.room - start - 1, remaining - 1))
        proposal = writable_prefix(
            proposal, self._never_drafted, self._ending_ids if req.stop_at_eos else ()
        )
        if not proposal:
            return False
        rows = [a.tokens[-1]] + proposal
        a.table.prepare_write(start, start + len(rows))
        view = PagedBatch(self.pool, [a.table.blocks], self.model.device)
        logits = self.model.forward_tail(rows, start, view)
        if logits is None:
            return False
        self.counters["draft_tokens"] += len(proposal)
        for j in range(len(rows)):
            a.computed = start + j + 1
            self._accept(a, logits[j])
            if a.output.finished or j == len(proposal) or a.tokens[-1] != proposal[j]:
                break
            self.counters["draft_accepted"] += 1
        return True

    def _accept(
        self,
        a: _Active,
        logits: torch.Tensor,
        first: bool = False,
        greedy_token: int | torch.Tensor | None = None,
    ) -> None:
        req = a.request
        if self.vocab_limit is not None:
            logits = logits[: self.vocab_limit]
        raw_logits = logits
        if greedy_token is not None and int(greedy_token) in self.tokenizer.unsampled_ids:
            greedy_token = None  # the device's argmax does not know the forbidden ids
        if a.forcing is not None and a.forcing.active:
            logits, greedy_token = (
                a.forcing.mask(logits),
                None,
            )  # the device's argmax is unconstrained
        if greedy_token is not None and req.temperature < GREEDY_BELOW:
            token = int(greedy_token)  # argmax already taken on the device
        else:
            logits = forbid(logits, self.tokenizer.unsampled_ids)
            token = int(sample(logits[None], req.temperature, req.top_p, a.generator))
        if first:
            a.first_token = time.monotonic()
            a.first_logits = (
                raw_logits.clone() if req.return_logits else None
            )  # graph outputs are reused
        if a.forcing is not None and a.forcing.active:
            a.forcing.advance(token)
        delta = a.output.push(token)
        a.tokens.append(token)
        if delta:
            self._emit(a, Event(req.id, "delta", text=delta))
        if a.output.finished:
            self.counters["completed"] += 1
            self._finish(a, a.output.finish_reason)

    # -- endings ----------------------------------------------------------------------------------
    def _finish(self, a: _Active, reason: str) -> None:
        if a.output is not None:
            tail = a.output.finish(reason)
            if tail:
                self._emit(a, Event(a.request.id, "delta", text=tail))
        self._release(a)
        now = time.monotonic()
        usage = dict(
            prompt_tokens=len(a.request.prompt_ids),
            cached_tokens=a.cached,
            completion_tokens=a.output.completion_tokens if a.output else 0,
            queue_ms=1000 * ((a.started or now) - a.submitted),
            prefill_ms=1000 * a.prefill_s,
            first_token_ms=1000 * (a.first_token - a.submitted) if a.first_token else None,
            total_ms=1000 * (now - a.submitted),
        )
        reason = a.output.finish_reason if a.output and a.output.finish_reason else reason
        self._emit(
            a, Event(a.request.id, "done", finish_reason=reason, usage=usage, logits=a.first_logits)
        )

    def _fail(self, a: _Active, message: str) -> None:
        self._release(a)
        self.counters["failed"] += 1
        self._emit(a, Event(a.request.id, "error", error=message, code=ErrorCode.ENGINE_ERROR))

    def _release(self, a: _Active) -> None:
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

    def _emit(self, a: _Active, event: Event) -> None:
        try:
            a.on_event(event)
        except Exception:  # noqa: BLE001 - a broken client callback must not stop the engine
            log.exception("event callback failed for request %s", a.request.id)
