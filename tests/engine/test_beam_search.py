"""Beam search for single-line completions: the beams' lean forward against the general path, the
search's rules on hand-made logits, and the same answer through `generate` and the engine."""

import math

import pytest
import torch
from checkpoints import LEAN_PATH_TOLERANCE as TOLERANCE
from checkpoints import lean_path_model
from engine_runs import complete

from engine.core.engine import Engine
from engine.core.options import EngineOptions
from engine.core.request import BadRequest, Request, check_request
from engine.decoding.beam_search import BeamSearch, BeamTails
from engine.ipc.protocol import MAX_BEAMS, CompletionParams
from engine.kv.pool import KVPool, PagedBatch
from engine.loading.loader import load_model
from engine.loading.tokenizer import Tokenizer
from engine.models import default_model_dir
from engine.prompts.fim import build_fim_prompt, healed_text


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# -- the beams' lean forward -----------------------------------------------------------------------


@pytest.mark.parametrize("form", ["fp32", "int8"])
@pytest.mark.parametrize("variant", ["moe", "dense_and_untied", "bias"])
def test_forward_beams_matches_each_beam_computed_alone(variant, form):
    """Beams that share a prompt and differ after it: at every step each beam's logits equal the
    general path's over that beam's whole sequence, also after beams are dropped and duplicated."""
    model = lean_path_model(variant, form)
    general = model.with_options(lean_decode=False)  # short sequences would take the lean path
    c = model.config
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, c.vocab_size, (11,), generator=g).tolist()
    table = [3, 0, 2, 1]  # out of order: the prompt's keys lie in several runs of slots
    pool = KVPool(c.num_layers, 4, 4, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    model.forward(
        torch.tensor([prompt]), torch.arange(len(prompt))[None], PagedBatch(pool, [table], "cpu")
    )
    before = [k.clone() for k in pool.keys]
    beams = [[t] for t in torch.randint(0, c.vocab_size, (3,), generator=g).tolist()]
    tails = BeamTails(c.num_layers)
    diffs = []
    for parents in (None, [0, 1, 2], [2, 2, 0], [1, 0, 0, 2]):
        if parents is not None:
            tails.select(parents)
            fresh = torch.randint(0, c.vocab_size, (len(parents),), generator=g).tolist()
            beams = [beams[p] + [t] for p, t in zip(parents, fresh)]
        position = len(prompt) + len(beams[0]) - 1
        lean = model.forward_beams(
            [b[-1] for b in beams], position, PagedBatch(pool, [table], "cpu"), tails
        )
        assert lean.shape == (len(beams), c.vocab_size)
        for row, beam in enumerate(beams):
            ids = prompt + beam
            alone = general.forward(
                torch.tensor([ids]), torch.arange(len(ids))[None], general.new_cache(1, len(ids))
            )[0, -1]
            diffs.append(_rel(lean[row], alone))
            if form == "fp32":
                assert torch.equal(lean[row].argmax(), alone.argmax())
    diffs.sort()
    if form == "int8":
        assert 0 < diffs[len(diffs) // 2] < TOLERANCE[form]
    else:
        assert diffs[-1] < TOLERANCE[form]
    assert all(
        torch.equal(a, b) for a, b in zip(before, pool.keys)
    )  # the beams never write the pool


def test_forward_beams_declines_where_it_does_not_apply():
    model = lean_path_model("moe", "fp32")
    c = model.config
    general = model.with_options(lean_decode=False)
    tails = BeamTails(c.num_layers)
    assert general.forward_beams([1, 2], 4, general.new_cache(1, 8), tails) is None
    assert (
        model.forward_beams([1] * 10, 4, model.new_cache(1, 8), tails) is None
    )  # more rows than one forward takes


# -- the search's rules, on hand-made logits -------------------------------------------------------


@pytest.fixture(scope="module")
def shipped():
    model_dir = default_model_dir()
    return load_model(model_dir), Tokenizer.from_dir(model_dir)


def _logits(tok, vocab, wanted: dict[str, float]):
    """Logits that give each text's (one) token the wanted probability, the rest ~0."""
    out = torch.full((vocab,), -30.0)
    for text, p in wanted.items():
        ids = tok.encode(text)
        assert len(ids) == 1, text
        out[ids[0]] = math.log(p)
    return out


def test_search_prefers_the_likelier_line_and_never_answers_a_blank_one(shipped):
    model, tok = shipped
    v = model.config.vocab_size
    search = BeamSearch(tok, 2, max_tokens=8, stop=("\n",))
    # Step 1: ending the line at once is likeliest (0.5), then "x" (0.3), then "y" (0.2). The blank
    # line is never the answer, and it does not take a beam's place.
    feed = search.step(_logits(tok, v, {"\n": 0.5, "x": 0.3, "y": 0.2})[None])
    parents, tokens = feed
    assert [tok.decode([t]) for t in tokens] == ["x", "y"] and parents == [0, 0]
    # Step 2: greedy would write "x1" (0.3 * 0.6 = 0.18); "y" then the line's end is likelier (0.2 *
    # 0.95 = 0.19), and nothing after "x1" can beat it.
    feed = search.step(
        torch.stack(
            [_logits(tok, v, {"\n": 0.4, "1": 0.6}), _logits(tok, v, {"\n": 0.95, "2": 0.05})]
        )
    )
    assert feed is None and search.done
    assert tok.decode(search.answer()) == "y\n"


def test_search_ends_when_no_live_beam_can_beat_the_best_finished_one(shipped):
    model, tok = shipped
    v = model.config.vocab_size
    search = BeamSearch(tok, 3, max_tokens=8, stop=("\n",))
    search.step(_logits(tok, v, {"a": 0.6, "b": 0.3, "c": 0.1})[None])
    # "a" ends (0.6 * 0.9 = 0.54): "b" (0.3) and "c" (0.1) can only fall below it.
    feed = search.step(
        torch.stack(
            [
                _logits(tok, v, {"\n": 0.9, "d": 0.1}),
                _logits(tok, v, {"\n": 0.5, "e": 0.5}),
                _logits(tok, v, {"\n": 0.5, "f": 0.5}),
            ]
        )
    )
    assert feed is None and search.done
    assert tok.decode(search.answer()) == "a\n"


def test_search_keeps_the_healed_text_and_the_token_budget(shipped):
    model, tok = shipped
    v = model.config.vocab_size
    search = BeamSearch(tok, 2, max_tokens=2, stop=("\n",), forced_text="    ")
    logits = torch.zeros(v)
    logits[tok.encode("x")[0]] = 5.0  # would be the pick without the healed indentation
    feed = search.step(logits[None])
    assert all(
        tok.decode([t]).startswith("    ") or "    ".startswith(tok.decode([t])) for t in feed[1]
    )
    steps = 1
    while feed is not None:
        feed = search.step(
            torch.randn(len(feed[1]), v, generator=torch.Generator().manual_seed(steps))
        )
        steps += 1
    text = tok.decode(search.answer())
    assert text.startswith("    ")
    assert steps <= 6  # the budget: at most 2 tokens after the healed text


def test_width_must_fit_one_forward():
    """Checked on admission (before any search starts) and on the wire."""
    for beams in (0, MAX_BEAMS + 1):
        with pytest.raises(BadRequest):
            check_request(Request([5], beams=beams), context_length=64)
    check_request(Request([5], beams=MAX_BEAMS), context_length=64)
    with pytest.raises(ValueError):
        CompletionParams.from_params({"prefix": "x", "beams": 0})
    with pytest.raises(ValueError):
        CompletionParams.from_params({"prefix": "x", "beams": True})
    assert CompletionParams.from_params({"prefix": "x", "beams": 4}).beams == 4


# -- through the engine, one-shot and beside others ------------------------------------------------

PREFIX = (
    "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n"
    "        return [line.rstrip() for line in f]\n\n\n"
    'def write_lines(path, lines):\n    with open(path, "w") as f:\n        '
)
SUFFIX = '\n\n\ndef main():\n    lines = read_lines("in.txt")\n    write_lines("out.txt", lines)\n'


@pytest.mark.parametrize("form", ["fp32", "int8"])
def test_generate_and_the_engine_give_the_same_beam_answer(shipped, form, monkeypatch):
    shipped_model, tok = shipped
    model = shipped_model.with_options(lean_weights=form)
    rows = []  # the beams of every search step: proof that the search ran, not greedy
    lean = model.forward_beams
    monkeypatch.setattr(
        model,
        "forward_beams",
        lambda tokens, *a, **kw: (rows.append(len(tokens)), lean(tokens, *a, **kw))[1],
    )
    prompt = build_fim_prompt(tok, PREFIX, SUFFIX, "spm", heal=True)
    forced = healed_text(tok, PREFIX)
    greedy, _ = complete(model, tok, prompt, max_tokens=24, stop=["\n"], forced_text=forced)
    text, stats = complete(
        model, tok, prompt, max_tokens=24, stop=["\n"], forced_text=forced, beams=4
    )
    assert text.strip() and "\n" not in text
    assert stats.finish_reason in ("stop", "eos")
    assert max(rows) == 4
    steps = len(rows)
    engine = Engine(model, tok)
    events = []
    engine.submit(
        Request(prompt, max_tokens=24, stop=("\n",), forced_text=forced, beams=4), events.append
    )
    engine.run_until_idle()
    assert "".join(e.text for e in events if e.kind == "delta") == text
    done = events[-1]
    assert done.kind == "done" and done.finish_reason == stats.finish_reason
    assert done.usage["completion_tokens"] == stats.completion_tokens
    assert len(rows) == 2 * steps  # the engine searched as generate did
    # Only the prompt went into the prefix cache: the beams' own K/V were never in the pool.
    shared, cached = engine.scheduler.allocator.match_prefix_partial(
        prompt + stats.token_ids, len(prompt) + 8
    )
    engine.scheduler.allocator.release(shared)
    assert cached == len(prompt)
    # Beams of 1 are greedy.
    one, _ = complete(model, tok, prompt, max_tokens=24, stop=["\n"], forced_text=forced, beams=1)
    assert one == greedy


def test_a_beam_request_cancelled_midway_ends_cleanly(shipped):
    model, tok = shipped
    prompt = build_fim_prompt(tok, PREFIX, SUFFIX, "spm", heal=True)
    engine = Engine(model, tok)
    events = []
    # No stop: a long search.
    rid = engine.submit(Request(prompt, max_tokens=24, beams=4), events.append)
    engine.step()  # the prompt
    engine.step()  # one beam step
    engine.cancel(rid)
    engine.run_until_idle()
    assert events[-1].kind == "done" and events[-1].finish_reason == "cancelled"
    assert not engine.scheduler.running and engine.scheduler.allocator.stats().blocks_used == 0
    # The engine goes on: the next request is served.
    engine.submit(Request(prompt, max_tokens=4, beams=4, stop=("\n",)), events.append)
    engine.run_until_idle()
    assert events[-1].kind == "done"


def test_a_deadline_during_the_search_ends_with_the_likeliest_line_so_far(shipped):
    model, tok = shipped
    prompt = build_fim_prompt(tok, PREFIX, SUFFIX, "spm", heal=True)
    engine = Engine(model, tok)
    events = []
    request = Request(prompt, max_tokens=24, beams=4, deadline_s=60.0)  # no stop: a long search
    engine.submit(request, events.append)
    for _ in range(4):  # the prompt, then three beam steps
        engine.step()
    request.deadline_s = 0.0
    engine.run_until_idle()
    assert events[-1].kind == "done" and events[-1].finish_reason == "deadline"
    # What the search had, as greedy would.
    assert "".join(e.text for e in events if e.kind == "delta")
    assert engine.scheduler.allocator.stats().blocks_used == 0


def test_beams_fit_one_lean_forward():
    from engine.model.qwen3_moe import LEAN_MAX_ROWS

    assert MAX_BEAMS <= LEAN_MAX_ROWS


def test_a_plain_cache_gives_the_prompt_run_and_refuses_a_gap():
    model = lean_path_model("moe", "fp32")
    cache = model.new_cache(1, 4)
    model.forward(torch.tensor([[3, 1, 4]]), torch.arange(3)[None], cache)
    assert cache.lean_rows(3, 0)[1] == [(0, 3)]  # a beam search's shared prompt
    slots, runs = cache.lean_rows(3, 2)  # two new rows
    assert slots == [3, 4] and runs == [(0, 5)] and cache.capacity >= 5
    assert cache.lean_rows(7, 0) is None  # positions 5 and 6 were never written


def test_sampling_requests_ignore_beams(shipped):
    model, tok = shipped
    prompt = build_fim_prompt(tok, PREFIX, SUFFIX, "spm", heal=True)
    a, _ = complete(model, tok, prompt, max_tokens=8, temperature=0.8, seed=3, beams=4)
    b, _ = complete(model, tok, prompt, max_tokens=8, temperature=0.8, seed=3)
    assert a == b


def test_cli_beams_prints_the_search_answer_and_refuses_a_bad_width(shipped):
    import subprocess
    import sys

    model, tok = shipped
    prompt = build_fim_prompt(tok, PREFIX, SUFFIX, "spm", heal=True)
    expected, _ = complete(
        model,
        tok,
        prompt,
        max_tokens=24,
        stop=["\n"],
        forced_text=healed_text(tok, PREFIX),
        beams=4,
    )
    args = [
        sys.executable,
        "-m",
        "engine.cli",
        "generate",
        "--fim-prefix",
        PREFIX,
        "--fim-suffix",
        SUFFIX,
        "--fim-order",
        "spm",
        "--stop",
        "\n",
        "--max-tokens",
        "24",
    ]
    if model.lean.form == "fp32":
        args += ["--cpu-decode-weights", "fp32"]
    result = subprocess.run(args + ["--beams", "4"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected and expected.strip()
    result = subprocess.run(args + ["--beams", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "beams" in result.stderr


def test_an_fp8_kv_pool_decodes_greedily_instead(shipped):
    """The beams' lean forward reads the prompt's K/V in place, which an fp8 pool cannot give."""
    model, tok = shipped
    prompt = build_fim_prompt(tok, PREFIX, SUFFIX, "spm", heal=True)
    forced = healed_text(tok, PREFIX)
    texts = []
    for beams in (1, 4):
        engine = Engine(model, tok, EngineOptions(kv_fp8=True))
        events = []
        engine.submit(
            Request(prompt, max_tokens=24, stop=("\n",), forced_text=forced, beams=beams),
            events.append,
        )
        engine.run_until_idle()
        assert events[-1].kind == "done"
        texts.append("".join(e.text for e in events if e.kind == "delta"))
    assert texts[0] == texts[1]


def test_stats_of_a_beam_request_rate_its_decode_time(shipped):
    """A beam search releases its text at its end, so the time after the first token is about
    nothing: the rate comes from the decode time (prompt's end to the request's end)."""
    from engine.cli import _stats_line

    model, tok = shipped
    prompt = build_fim_prompt(tok, PREFIX, SUFFIX, "spm", heal=True)
    _, done = complete(
        model, tok, prompt, max_tokens=24, forced_text=healed_text(tok, PREFIX), beams=4
    )
    usage = done.check().usage
    assert len(done.token_ids) > 1
    # Within the request's own time, after its queue and prefill; longer than the time after
    # the released first token, which a beam search reaches only at its end.
    assert 0 < usage["decode_ms"] <= usage["total_ms"] - usage["queue_ms"] - usage["prefill_ms"]
    assert usage["decode_ms"] > usage["total_ms"] - usage["first_token_ms"]
    rate = float(_stats_line(0.0, done).split("decode ")[1].split(" tok/s")[0])
    expected = (len(done.token_ids) - 1) / (usage["decode_ms"] / 1000)
    assert math.isfinite(rate) and rate == pytest.approx(expected, abs=0.05)
