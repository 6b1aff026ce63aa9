"""The engine loop: prefix-cache exactness, batching, cancellation, supersession, full pools."""

import pytest
import torch
from engine_runs import complete, small_engine

from engine.core.engine import Engine
from engine.core.options import EngineOptions
from engine.core.request import Request
from engine.kv.pool import PagedBatch
from engine.kv.sequence import BlockTable
from engine.loading.loader import load_model
from engine.loading.tokenizer import Tokenizer

CODE = (
    "import os\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n"
    "def add(a, b):\n    return a + b\nfor i in range(10):\n    print(i * i)\n"
)


@pytest.fixture(scope="module")
def tiny(checkpoint_factory):
    path = checkpoint_factory()
    return load_model(path), Tokenizer.from_dir(path)


def run(engine, request):
    """Submit, drive the loop synchronously, return (text, done-or-error event)."""
    events = []
    engine.submit(request, events.append)
    engine.run_until_idle()
    text = "".join(e.text for e in events if e.kind == "delta")
    return text, events[-1]


def max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_cache_hits_give_cold_logits(tiny):
    tiny_model, tok = tiny
    # A hit computes its last tokens on the lean path: in fp32 it differs from the cold prefill
    # in rounding alone, so a stale or misplaced cached K/V would show.
    model = tiny_model.with_options(lean_weights="fp32")
    prompt = tok.encode(CODE)
    assert len(prompt) > 40
    cold_engine = small_engine(model, tok)
    _, cold = run(cold_engine, Request(prompt, max_tokens=1, return_logits=True))
    assert cold.usage["cached_tokens"] == 0

    engine = small_engine(model, tok)
    _, warm = run(engine, Request(prompt[:-3], warm_only=True))
    assert warm.finish_reason == "warmed"
    _, hit = run(engine, Request(prompt, max_tokens=1, return_logits=True))
    # Whole blocks and the warm-up's partly filled last block: only the 3 new tokens computed.
    assert hit.usage["cached_tokens"] == len(prompt) - 3
    assert max_rel(hit.logits, cold.logits) < 1e-5

    # The same prompt again: everything but the last token is served from the cache.
    _, again = run(engine, Request(prompt, max_tokens=1, return_logits=True))
    assert again.usage["cached_tokens"] == (len(prompt) - 1) // 8 * 8
    assert max_rel(again.logits, cold.logits) < 1e-5

    # A prompt that diverges mid-block shares the tokens before the divergence: two whole
    # blocks, and a copy of the third block's first five tokens.
    other = prompt[:21] + tok.encode("zzz = 3\n")
    assert other[21] != prompt[21]
    _, partial = run(engine, Request(other, max_tokens=1, return_logits=True))
    assert partial.usage["cached_tokens"] == 21
    _, partial_cold = run(
        small_engine(model, tok),
        Request(other, max_tokens=1, return_logits=True),
    )
    assert max_rel(partial.logits, partial_cold.logits) < 1e-5


def test_paged_logits_match_contiguous_cache(tiny):
    model, tok = tiny
    prompt = tok.encode(CODE)
    _, paged = run(
        small_engine(model, tok),
        Request(prompt, max_tokens=1, return_logits=True),
    )
    contiguous = model.forward(
        torch.tensor([prompt]), torch.arange(len(prompt))[None], model.new_cache(1)
    )[0, -1]
    assert max_rel(paged.logits, contiguous) < 1e-5


def test_after_eviction_and_reprefill(tiny):
    model, tok = tiny
    prompt = tok.encode(CODE)
    engine = Engine(model, tok, EngineOptions(num_blocks=12, block_size=8))
    _, first = run(engine, Request(prompt, max_tokens=1, return_logits=True))
    for i in range(3):  # other prompts push the first one's blocks out
        run(engine, Request(tok.encode(f"filler {i} " * 5), warm_only=True))
    assert engine.stats()["evictions"] > 0
    _, again = run(engine, Request(prompt, max_tokens=1, return_logits=True))
    assert again.usage["cached_tokens"] < (len(prompt) - 1) // 8 * 8
    assert max_rel(again.logits, first.logits) < 1e-5
    assert engine.stats()["blocks_used"] == 0


def test_fork_copies_the_shared_partial_block(tiny):
    model, tok = tiny
    engine = Engine(model, tok, EngineOptions(num_blocks=32, block_size=8))
    prompt = tok.encode(CODE)[:20]  # 2.5 blocks: the fork shares a partial block
    a_tail, b_tail = tok.encode(" alpha"), tok.encode(" beta gamma")
    table = BlockTable(engine.scheduler.allocator, engine.runner.pool)

    def forward(tbl, tokens, start):
        tbl.prepare_write(start, start + len(tokens))
        pos = torch.arange(start, start + len(tokens))[None]
        return model.forward(
            torch.tensor([tokens]), pos, PagedBatch(engine.runner.pool, [tbl.blocks], "cpu")
        )[0, -1]

    forward(table, prompt, 0)
    fork = table.fork()
    shared_tail = table.blocks[2]
    logits_a = forward(table, a_tail, len(prompt))
    logits_b = forward(fork, b_tail, len(prompt))
    # The first writer copied the shared partial block; the second then owned the original.
    assert table.blocks[2] != shared_tail and fork.blocks[2] == shared_tail
    assert table.blocks[:2] == fork.blocks[:2]
    for tail, got in ((a_tail, logits_a), (b_tail, logits_b)):
        seq = prompt + tail
        cold = model.forward(torch.tensor([seq]), torch.arange(len(seq))[None], model.new_cache(1))[
            0, -1
        ]
        assert max_rel(got, cold) < 1e-5
    table.free()
    fork.free()
    engine.scheduler.allocator.check_invariants()
    assert engine.stats()["blocks_used"] == 0


def test_fp8_cache_is_close_and_smaller(tiny):
    model, tok = tiny
    prompt = tok.encode(CODE)
    _, exact = run(
        small_engine(model, tok),
        Request(prompt, max_tokens=1, return_logits=True),
    )
    fp8 = small_engine(model, tok, kv_fp8=True)
    _, approx = run(fp8, Request(prompt, max_tokens=1, return_logits=True))
    assert max_rel(approx.logits, exact.logits) < 0.1
    full = small_engine(model, tok).stats()["kv_bytes_per_token"]
    assert fp8.stats()["kv_bytes_per_token"] < 0.6 * full
    assert fp8.stats()["kv_format"] == "fp8_e4m3"


def test_batched_decode_equals_single_generation(tiny):
    model, tok = tiny
    prompts = [
        tok.encode(p)
        for p in ("def add(a, b):", "class Point:\n", "for i in range(", "import os\n" * 3)
    ]
    engine = small_engine(model, tok)
    results = {}
    for i, p in enumerate(prompts):
        results[i] = []
        engine.submit(Request(p, max_tokens=12, stop_at_eos=False), results[i].append)
    engine.run_until_idle()
    for i, p in enumerate(prompts):
        expected, _ = complete(model, tok, p, max_tokens=12, stop_at_eos=False)
        assert "".join(e.text for e in results[i] if e.kind == "delta") == expected
        assert results[i][-1].finish_reason == "length"
    assert engine.stats()["blocks_used"] == 0


@pytest.mark.parametrize("when", ["prefill", "decode", "waiting"])
def test_cancel_frees_everything(tiny, when):
    model, tok = tiny
    engine = small_engine(model, tok, prefill_chunk=8)
    events = []
    rid = engine.submit(Request(tok.encode(CODE), max_tokens=50, stop_at_eos=False), events.append)
    steps = {"waiting": 0, "prefill": 1, "decode": 12}[when]
    for _ in range(steps):
        engine.step()
    assert (engine.stats()["blocks_used"] > 0) == (when != "waiting")
    engine.cancel(rid)
    engine.run_until_idle()
    assert events[-1].kind == "done" and events[-1].finish_reason == "cancelled"
    assert engine.stats()["blocks_used"] == 0
    engine.scheduler.allocator.check_invariants()


def test_full_pool_queues_then_rejects_clearly(tiny):
    model, tok = tiny
    engine = Engine(model, tok, EngineOptions(num_blocks=4, block_size=8))
    first, second = [], []
    engine.submit(
        Request(tok.encode("def add(a, b):"), max_tokens=12, stop_at_eos=False), first.append
    )
    engine.submit(
        Request(tok.encode("class Point:"), max_tokens=12, stop_at_eos=False), second.append
    )
    engine.step()
    assert engine.stats()["waiting"] == 1  # the second waits for blocks, it is not rejected
    engine.run_until_idle()
    assert first[-1].kind == "done" and second[-1].kind == "done"
    _, err = run(engine, Request(tok.encode(CODE), max_tokens=8))
    assert err.kind == "error" and "needs" in err.error and "pool has 4" in err.error
    assert engine.stats()["blocks_used"] == 0


def test_newer_request_of_a_client_supersedes_and_completions_preempt_warms(tiny):
    model, tok = tiny
    engine = small_engine(model, tok, prefill_chunk=8)
    log = []
    engine.submit(Request(tok.encode(CODE), warm_only=True, client="a", id="warm-a"), log.append)
    engine.submit(Request(tok.encode(CODE), warm_only=True, client="b", id="warm-b"), log.append)
    engine.step()
    engine.submit(
        Request(tok.encode(CODE[:40]), max_tokens=4, client="a", id="complete-a"), log.append
    )
    engine.run_until_idle()
    done = [(e.request_id, e.finish_reason) for e in log if e.kind == "done"]
    assert ("warm-a", "superseded") in done
    # The completion's prefill ran before the other client's warm-up finished.
    assert [r for r, _ in done].index("complete-a") < [r for r, _ in done].index("warm-b")
    assert engine.stats()["blocks_used"] == 0


def test_deadline_ends_a_request_with_what_it_has(tiny):
    model, tok = tiny
    engine = small_engine(model, tok)
    _, done = run(engine, Request(tok.encode(CODE), max_tokens=50, deadline_s=0.0))
    assert done.finish_reason == "deadline"
    assert engine.stats()["blocks_used"] == 0


def test_engine_thread_serves_requests(tiny):
    import threading

    model, tok = tiny
    engine = small_engine(model, tok)
    thread = engine.start_thread()
    finished = threading.Event()
    events = []

    def on_event(e):
        events.append(e)
        if e.kind != "delta":
            finished.set()

    engine.submit(Request(tok.encode("def add(a, b):"), max_tokens=8, stop_at_eos=False), on_event)
    assert finished.wait(30)
    engine.stop()
    thread.join(5)
    assert events[-1].kind == "done" and events[-1].usage["completion_tokens"] == 8


def test_prefix_cache_can_be_switched_off(tiny):
    model, tok = tiny
    engine = small_engine(model, tok, prefix_cache=False)
    prompt = tok.encode(CODE)
    run(engine, Request(prompt, warm_only=True))
    _, done = run(engine, Request(prompt, max_tokens=1))
    assert done.usage["cached_tokens"] == 0 and engine.stats()["prefix_cache"] is False
    assert engine.stats()["blocks_evictable"] == 0 and engine.stats()["blocks_used"] == 0


def test_slot_runs_merge_consecutive_blocks():
    from engine.kv.pool import slot_runs

    assert slot_runs([3, 4, 5], 4, 10) == [(12, 22)]
    assert slot_runs([3, 7, 8, 2], 4, 16) == [(12, 16), (28, 36), (8, 12)]
    assert slot_runs([3, 7], 4, 5) == [(12, 16), (28, 29)]


def test_partial_block_copy_is_reserved_at_admission(tiny):
    """Reusing part of a cached block takes one more block (its copy): admission must count and
    take it, so a request admitted alongside cannot leave it without one."""
    model, tok = tiny
    engine = Engine(model, tok, EngineOptions(num_blocks=6, block_size=4))
    warm = [11, 12, 13, 14, 15, 16]  # one full block and a partly filled one, cached
    run(engine, Request(warm, warm_only=True))
    events = {}
    engine.submit(
        Request(warm + [17], max_tokens=1, stop_at_eos=False), lambda e: events.setdefault("b", e)
    )
    engine.submit(
        Request(list(range(30, 45)), max_tokens=1, stop_at_eos=False),
        lambda e: events.setdefault("c", []).append(e),
    )
    engine.run_until_idle()
    assert events["b"].kind == "done", events["b"].error
    assert events["c"][-1].kind == "done"
    engine.scheduler.allocator.check_invariants()
    assert engine.stats()["blocks_used"] == 0


def test_request_as_large_as_the_pool_recomputes_a_partial_hit(tiny):
    """When the copy of a partly reused block is the one block too many, the request computes
    those tokens again instead of waiting for a block that can never come."""
    model, tok = tiny
    engine = Engine(model, tok, EngineOptions(num_blocks=3, block_size=4))
    warm = [11, 12, 13, 14, 15, 16]
    run(engine, Request(warm, warm_only=True))
    _, done = run(
        engine, Request(warm + [17], max_tokens=5, stop_at_eos=False)
    )  # 12 tokens: the whole pool
    assert done.kind == "done" and done.usage["completion_tokens"] == 5
    assert done.usage["cached_tokens"] == 4  # the whole block only
    engine.scheduler.allocator.check_invariants()


def _by_id(engine, request_id):
    return next(
        a for a in engine.scheduler.running + engine.scheduler.waiting if a.request.id == request_id
    )


def test_a_lone_owner_is_held_back_neither_by_its_share_nor_by_its_own_warm_up(tiny):
    """The pool share binds only while another owner is there, and counts no warm-up: alone, the
    LSP's completions start at once beside its own warm-up on a small pool."""
    model, tok = tiny
    engine = small_engine(model, tok, prefill_chunk=8)
    assert engine.scheduler.owner_block_limit == 16
    prompt = tok.encode(CODE)  # 89 tokens: 12 blocks
    engine.submit(Request(prompt, warm_only=True, owner="lsp", id="warm"), lambda e: None)
    engine.step()
    for i in range(3):  # 41 + 16 tokens: 8 blocks each, 36 with the warm-up's, of 64
        request = Request(prompt[:40] + [i], max_tokens=16, owner="lsp", id=f"complete{i}")
        engine.submit(request, lambda e: None)
    engine.step()
    assert {a.request.id for a in engine.scheduler.running} == {
        "warm",
        "complete0",
        "complete1",
        "complete2",
    }
    assert not engine.scheduler.waiting and not _by_id(engine, "warm").decoding  # nothing preempted
    engine.run_until_idle()
    assert engine.stats()["blocks_used"] == 0


@pytest.mark.parametrize("warm_owner", ["lsp", "other"])
def test_a_completion_preempts_warm_ups_for_blocks_its_own_owners_too(tiny, warm_owner):
    model, tok = tiny
    engine = Engine(
        model, tok, EngineOptions(num_blocks=16, block_size=8, prefill_chunk=8)
    )  # a share of 4 blocks
    done = {}

    def record(event):
        if event.kind != "delta":
            done[event.request_id] = event

    engine.submit(
        Request(tok.encode(CODE), warm_only=True, owner=warm_owner, id="warm"), record
    )  # 12 blocks
    engine.step()
    completion = Request(
        tok.encode(CODE.upper())[:40], max_tokens=16, stop_at_eos=False, owner="lsp", id="complete"
    )  # 7 blocks: more than are free
    engine.submit(completion, record)
    engine.step()
    assert done["warm"].finish_reason == "preempted"
    assert [a.request.id for a in engine.scheduler.running] == ["complete"]
    engine.run_until_idle()
    assert done["complete"].kind == "done" and done["complete"].usage["completion_tokens"] == 16


def test_requests_without_an_owner_are_prefilled_first_come_first_served(tiny):
    """The CLI's, evals' and benchmarks' requests share one fairness key: none takes turns with
    an earlier one's prefill, and a new arrival waits behind the prefills already running."""
    model, tok = tiny
    engine = small_engine(model, tok, prefill_chunk=8)
    texts = {"first": CODE, "second": CODE.upper(), "third": CODE.swapcase()[::-1]}

    def submit(name):
        request = Request(tok.encode(texts[name]), max_tokens=20, stop_at_eos=False, id=name)
        engine.submit(request, lambda e: None)

    submit("first")
    submit("second")
    engine.step()
    while not _by_id(engine, "first").decoding:
        assert _by_id(engine, "second").computed == 0
        engine.step()
    submit("third")
    engine.step()
    while not _by_id(engine, "second").decoding:
        assert _by_id(engine, "third").computed == 0
        engine.step()
    engine.run_until_idle()
    assert engine.stats()["blocks_used"] == 0


def test_a_dropped_engine_frees_its_pool_at_once(tiny):
    """No reference cycle holds an engine: tools that build one engine after another (the
    benchmarks, one-shot runs) must not keep every old KV pool until the garbage collector runs."""
    import gc
    import weakref

    model, tok = tiny
    gc.disable()
    try:
        engine = small_engine(model, tok)
        engine.complete(Request(tok.encode("def add(a, b):"), max_tokens=4, seed=1))
        dropped, pool = weakref.ref(engine), weakref.ref(engine.runner.pool)
        del engine
        assert dropped() is None and pool() is None
    finally:
        gc.enable()
