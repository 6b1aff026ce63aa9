"""Prompt-lookup speculative decoding: the lean forward of a few rows against the general path,
the drafts, and the engine's output with speculation on against plain greedy decoding."""

import pytest
import torch
from checkpoints import LEAN_PATH_TOLERANCE as TOLERANCE
from checkpoints import lean_path_model
from engine_runs import small_engine

from engine.core.engine import Engine
from engine.core.options import EngineOptions
from engine.core.request import Request
from engine.decoding.prompt_lookup import draft, writable_prefix
from engine.kv.pool import KVPool, PagedBatch
from engine.loading.loader import load_model
from engine.loading.random_model import TINY, random_model
from engine.loading.tokenizer import Tokenizer
from engine.model.options import ModelOptions
from engine.models import default_model_dir
from engine.prompts.fim import build_fim_prompt

REPETITIVE = "self.x = x\nself.y = y\nself.z = z\n" * 6 + "self.x = x\nself."
CODE = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return "
)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# -- the lean forward of a few rows ----------------------------------------------------------------


def _row_diffs(lean, general):
    return sorted(_rel(a, b) for a, b in zip(lean, general))


@pytest.mark.parametrize("form", ["fp32", "int8"])
@pytest.mark.parametrize("variant", ["moe", "dense_and_untied", "bias"])
def test_forward_tail_matches_the_general_path(variant, form):
    model = lean_path_model(variant, form)
    general_path = model.with_options(lean_decode=False)  # short tails would take the lean path
    c = model.config
    table = [5, 2, 3, 0, 4]  # out of order: the keys lie in several runs of slots
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (1, 20), generator=g).tolist()[0]
    for prompt, rows in ((7, 2), (7, 9), (3, 5), (1, 9)):
        pools = [
            KVPool(c.num_layers, 6, 4, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
            for _ in range(2)
        ]
        for pool in pools:
            model.forward(
                torch.tensor([ids[:prompt]]),
                torch.arange(prompt)[None],
                PagedBatch(pool, [table], "cpu"),
            )
        new = ids[prompt : prompt + rows]
        lean = model.forward_tail(new, prompt, PagedBatch(pools[0], [table], "cpu"))
        general = general_path.forward(
            torch.tensor([new]),
            torch.arange(prompt, prompt + rows)[None],
            PagedBatch(pools[1], [table], "cpu"),
        )[0]
        assert lean.shape == general.shape == (rows, c.vocab_size)
        diffs = _row_diffs(lean, general)
        if form == "int8":
            assert 0 < diffs[len(diffs) // 2] < TOLERANCE[form]
            continue
        assert diffs[-1] < TOLERANCE[form]
        assert torch.equal(lean.argmax(-1), general.argmax(-1))
        for store in ("keys", "values"):  # the same K/V written at the same slots
            for a, b in zip(getattr(pools[0], store), getattr(pools[1], store)):
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
                assert (a != 0).any()


def test_forward_tail_declines_where_it_does_not_apply():
    model = random_model(dict(TINY, vocab_size=512), dtype=torch.float32, seed=6)
    c = model.config
    pool = KVPool(c.num_layers, 4, 4, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    assert (
        model.forward_tail(list(range(10)), 0, PagedBatch(pool, [[0, 1, 2]], "cpu")) is None
    )  # too many rows
    assert (
        model.forward_tail([1, 2], 0, PagedBatch(pool, [[0], [1]], "cpu")) is None
    )  # two sequences
    fp8 = KVPool(c.num_layers, 4, 4, c.num_kv_heads, c.head_dim, torch.float32, "cpu", fp8=True)
    assert model.forward_tail([1, 2], 0, PagedBatch(fp8, [[0]], "cpu")) is None
    general = model.with_options(lean_decode=False)
    assert general.forward_tail([1, 2], 0, PagedBatch(pool, [[0]], "cpu")) is None


# The default model's own forms: fp32 copies, and its int4 groups as stored (bf16 activations,
# within int8's tolerance).
@pytest.mark.parametrize("form", ["fp32", "int4"])
def test_forward_tail_on_the_shipped_model(form):
    from engine.model.lean_matrices import int4_available

    if form == "int4" and not int4_available():
        pytest.skip("this torch lacks the CPU int4 product")
    d = default_model_dir()
    model, tok = load_model(d, options=ModelOptions(lean_weights=form)), Tokenizer.from_dir(d)
    c = model.config
    ids = tok.encode(CODE)
    table = [3, 0, 7, 1, 2]
    pools = [
        KVPool(c.num_layers, 8, 16, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
        for _ in range(2)
    ]
    start = len(ids) - 6
    for pool in pools:
        model.forward(
            torch.tensor([ids[:start]]), torch.arange(start)[None], PagedBatch(pool, [table], "cpu")
        )
    lean = model.forward_tail(ids[start:], start, PagedBatch(pools[0], [table], "cpu"))
    # A six-token prompt would take the lean forward too: the reference is the general path.
    general = model.with_options(lean_decode=False).forward(
        torch.tensor([ids[start:]]),
        torch.arange(start, len(ids))[None],
        PagedBatch(pools[1], [table], "cpu"),
    )[0]
    diffs = _row_diffs(lean, general)
    # Every row: the shipped router is not near-tied here.
    assert 0 < max(diffs) < TOLERANCE["fp32" if form == "fp32" else "int8"]
    assert torch.equal(lean.argmax(-1), general.argmax(-1))


# -- drafts ----------------------------------------------------------------------------------------


def test_draft_copies_what_followed_the_most_recent_match():
    seq = [1, 2, 3, 4, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]
    assert draft(seq, 3, (4, 3)) == [5, 6, 7]  # the later of two occurrences
    assert draft(seq, 8, (4,)) == [5, 6, 7, 8, 1, 2, 3, 4]
    assert draft([1, 2, 3, 1, 2, 3], 8, (3,)) == [1, 2, 3]  # runs up to the end of the sequence
    assert draft([5, 6, 7, 8], 4, (3, 2)) == []  # no earlier occurrence
    assert draft([7, 1, 7], 4, (2,)) == []
    assert draft([7, 1, 7], 4, (1,)) == [1, 7]
    assert draft(seq, 0, (4,)) == []


def test_a_draft_stops_where_decoding_could_not_follow():
    never, ending = {2, 3}, {0}
    assert writable_prefix([7, 8, 2, 9], never, ending) == [
        7,
        8,
    ]  # a control token is never written
    assert writable_prefix([7, 0, 9], never, ending) == [7, 0]  # an ending token ends the output
    assert writable_prefix([7, 0, 9], never, ()) == [7, 0, 9]  # unless the request ignores EOS
    assert writable_prefix([3, 7], never, ending) == []
    assert writable_prefix([7, 8], never, ending) == [7, 8]


# -- the engine: speculation on against off --------------------------------------------------------


# These compare texts token for token, so the lean path runs in fp32. With int8 weights a verify
# forward rounds differently from a one-row step (bf16 results), and which near-tie flips with
# that depends on the CPU's int8 kernel: 1 of 60 held-out completions differed (BENCHMARKS.md).
@pytest.fixture(scope="module")
def tiny(checkpoint_factory):
    path = checkpoint_factory()
    model = load_model(path, options=ModelOptions(lean_weights="fp32"))
    return model, Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def shipped():
    d = default_model_dir()
    model = load_model(d, options=ModelOptions(lean_weights="fp32"))
    return model, Tokenizer.from_dir(d)


def run(engine, request):
    events = []
    engine.submit(request, events.append)
    engine.run_until_idle()
    return "".join(e.text for e in events if e.kind == "delta"), events[-1]


def generated_tokens(engine, request):
    """Text, done event, and the tokens (prompt and output) the request ended with."""
    seen = {}
    release = engine._release
    engine._release = lambda a: (
        seen.setdefault("tokens", (list(a.tokens), a.computed)),
        release(a),
    )[1]
    try:
        text, done = run(engine, request)
    finally:
        engine._release = release
    return text, done, seen["tokens"]


def both(model, tok, request_args, **engine_args):
    """The same request through a plain and a speculative engine: (text, event, tokens) each, and
    the speculative engine's stats."""
    out = []
    for speculative in (False, True):
        engine = small_engine(model, tok, speculative=speculative, **engine_args)
        out.append(generated_tokens(engine, Request(**request_args)))
    return out[0], out[1], engine.stats()


def assert_same(plain, spec):
    (p_text, p_done, p_tokens), (s_text, s_done, s_tokens) = plain, spec
    assert s_tokens[0] == p_tokens[0]
    assert s_text == p_text
    assert s_done.finish_reason == p_done.finish_reason
    assert s_done.usage["completion_tokens"] == p_done.usage["completion_tokens"]


@pytest.mark.parametrize("model_name", ["tiny", "shipped"])
@pytest.mark.parametrize("text", [REPETITIVE, CODE, "import os\nimport sys\nimport os.path\n"])
def test_speculation_gives_the_plain_greedy_tokens(request, model_name, text):
    model, tok = request.getfixturevalue(model_name)
    plain, spec, stats = both(
        model, tok, dict(prompt_ids=tok.encode(text), max_tokens=40, stop_at_eos=False)
    )
    assert_same(plain, spec)
    assert spec[1].usage["completion_tokens"] == 40
    if text == REPETITIVE:
        assert stats["draft_accepted"] > 0


def test_drafts_are_accepted_and_rejected(shipped):
    model, tok = shipped
    _, _, stats = both(
        model, tok, dict(prompt_ids=tok.encode(REPETITIVE), max_tokens=40, stop_at_eos=False)
    )
    assert stats["draft_accepted"] >= 20  # the repeated lines come from drafts
    _, _, stats = both(
        model, tok, dict(prompt_ids=tok.encode(CODE), max_tokens=40, stop_at_eos=False)
    )
    assert stats["draft_accepted"] < stats["draft_tokens"]


def test_max_tokens_reached_anywhere_in_a_draft(shipped):
    model, tok = shipped
    prompt = tok.encode(REPETITIVE)
    for max_tokens in range(1, 20):
        plain, spec, stats = both(
            model, tok, dict(prompt_ids=prompt, max_tokens=max_tokens, stop_at_eos=False)
        )
        assert_same(plain, spec)
        assert (
            spec[1].finish_reason == "length" and spec[1].usage["completion_tokens"] == max_tokens
        )
        assert len(spec[2][0]) == len(prompt) + max_tokens  # nothing past the end was taken
    assert stats["draft_accepted"] > 0


def test_stop_strings_inside_an_accepted_draft(shipped):
    model, tok = shipped
    prompt = tok.encode(REPETITIVE)
    full, _ = run(
        Engine(model, tok, EngineOptions(speculative=False)),
        Request(prompt, max_tokens=30, stop_at_eos=False),
    )
    assert len(full) > 30
    stops = {full[i : i + 3] for i in range(1, 30, 2)} | {"= ", "\n", full[-2:]}
    for stop in stops:
        plain, spec, _ = both(
            model, tok, dict(prompt_ids=prompt, max_tokens=30, stop=(stop,), stop_at_eos=False)
        )
        assert_same(plain, spec)
        assert stop not in spec[0] and spec[1].finish_reason == "stop"


def test_eos_inside_a_draft(shipped, monkeypatch):
    model, tok = shipped
    prompt = tok.encode(REPETITIVE)
    _, _, (tokens, _) = generated_tokens(
        Engine(model, tok, EngineOptions(speculative=False)),
        Request(prompt, max_tokens=20, stop_at_eos=False),
    )
    output, eos_ids = tokens[len(prompt) :], tuple(tok.eos_ids)
    for k in (3, 6, 9, 12):
        # A token the completion writes counts as an end of text: it ends wherever it lands.
        monkeypatch.setattr(tok, "eos_ids", eos_ids + (output[k],))
        plain, spec, _ = both(model, tok, dict(prompt_ids=prompt, max_tokens=20))
        assert_same(plain, spec)
        assert spec[1].finish_reason == "eos" and spec[1].usage[
            "completion_tokens"
        ] == output.index(output[k])


def test_healing_then_speculation(shipped):
    model, tok = shipped
    prompt = build_fim_prompt(tok, REPETITIVE[:-5], "\n", "spm", heal=True)
    args = dict(prompt_ids=prompt, max_tokens=24, forced_text="self.", stop=("\n",))
    plain, spec, stats = both(model, tok, args)
    assert_same(plain, spec)


def test_prefix_cache_hit_then_speculation_and_a_follow_up(shipped):
    model, tok = shipped
    # The cached K/V are checked against a fresh prefill's to fp32 rounding: the lean path in fp32.
    assert model.lean.form == "fp32"
    prompt = tok.encode(REPETITIVE)
    cold, _ = run(
        Engine(model, tok, EngineOptions(speculative=False, prefix_cache=False)),
        Request(prompt, max_tokens=30, stop_at_eos=False),
    )

    engine = small_engine(model, tok, speculative=True)
    run(engine, Request(prompt[:-3], warm_only=True))  # a partly filled last block
    text, done, (tokens, computed) = generated_tokens(
        engine, Request(prompt, max_tokens=30, stop_at_eos=False)
    )
    assert done.usage["cached_tokens"] == len(prompt) - 3 and (len(prompt) - 3) % 8
    assert text == cold
    assert engine.stats()["draft_accepted"] > 0
    assert computed == len(tokens) - 1

    # A follow-up reuses the finished request's cached K/V (the generated ones too), then
    # diverges inside a block whose later slots held K/V of rejected draft tokens.
    follow = tokens[: computed - 2] + tok.encode(" q")
    _, hit = run(engine, Request(follow, max_tokens=1, return_logits=True))
    assert hit.usage["cached_tokens"] >= computed - 2 - 8 and hit.usage["cached_tokens"] > len(
        prompt
    )
    _, fresh = run(
        Engine(model, tok, EngineOptions(prefix_cache=False)),
        Request(follow, max_tokens=1, return_logits=True),
    )
    assert _rel(hit.logits, fresh.logits) < 1e-5


def test_an_spm_prompt_never_drafts_its_control_tokens(shipped):
    """In an SPM prompt the prefix runs into <|fim_middle|>: a match near the cursor copies it
    unless the draft is cut there (rows that could never be accepted)."""
    model, tok = shipped
    prompt = build_fim_prompt(tok, "def fibonacci(n):\n    ", "\n\nprint(fibonacci(10))\n", "spm")
    drafted = []
    engine = Engine(model, tok, EngineOptions(speculative=True))
    verify = model.forward_tail
    try:
        model.forward_tail = lambda rows, *a: (drafted.append(rows[1:]), verify(rows, *a))[1]
        spec = generated_tokens(engine, Request(prompt, max_tokens=24, stop_at_eos=False))
    finally:
        del model.forward_tail
    plain = generated_tokens(
        Engine(model, tok, EngineOptions(speculative=False)),
        Request(prompt, max_tokens=24, stop_at_eos=False),
    )
    assert_same(plain, spec)
    assert drafted and not any(set(d) & set(tok.unsampled_ids) for d in drafted)


def test_no_draft_is_made_where_the_verify_forward_cannot_run(tiny):
    """An fp8 KV pool (as CUDA graphs or a model without the lean path) has no lean rows forward:
    the engine never speculates there, so the prompt-lookup scan and its writes are not wasted."""
    model, tok = tiny
    assert Engine(model, tok, EngineOptions()).speculates
    assert not Engine(model, tok, EngineOptions(speculative=False)).speculates
    engine = Engine(model, tok, EngineOptions(kv_fp8=True))
    assert not engine.speculates

    def no_step(*args):
        raise AssertionError("speculated without a verify forward")

    engine.speculation.step = no_step
    text, done = run(engine, Request(tok.encode(REPETITIVE), max_tokens=12, stop_at_eos=False))
    assert done.kind == "done" and done.usage["completion_tokens"] == 12
    assert engine.stats()["draft_tokens"] == 0
