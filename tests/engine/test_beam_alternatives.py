"""Several completions from one beam search (`n` > 1): the answer is the one it is without them;
the others are the next likeliest finished lines, distinct, never blank, best first, within the
margin; they reach the client in the final result, through the engine and the daemon."""

import random

import pytest
import torch

from engine.core.engine import Engine
from engine.core.request import BadRequest, Request, check_request
from engine.decoding.beam_search import ALTERNATIVE_MARGIN, BeamSearch
from engine.ipc.client import EngineClient, SpawnConfig
from engine.ipc.protocol import FEATURE_N, FEATURES, MAX_COMPLETIONS, CompletionParams
from engine.loading.loader import load_model
from engine.loading.tokenizer import Tokenizer
from engine.models import default_model_dir
from engine.prompts.fim import build_fim_prompt, healed_text


@pytest.fixture(scope="module")
def shipped():
    model_dir = default_model_dir()
    return load_model(model_dir), Tokenizer.from_dir(model_dir)


# -- the search, on a made-up model ----------------------------------------------------------------

PIECES = ["a", "b", "c", "ab", " x", "\n"]  # "ab" and "a"+"b" write the same text


def _toy(tok, vocab: int, seed: int):
    """Next-token logits for any token sequence, made up (but fixed) per sequence: a few pieces
    likely, every other token far less so."""
    ids = [tok.encode(p) for p in PIECES]
    assert all(len(i) == 1 for i in ids)
    ids = [i[0] for i in ids]

    def logits(tokens: list[int]) -> torch.Tensor:
        rng = random.Random(hash((seed, tuple(tokens))))
        out = torch.full((vocab,), -40.0)
        for i in ids:
            out[i] = rng.uniform(-4.0, 0.0)
        if len(tokens) >= 4:  # lines end sooner or later
            out[ids[-1]] = 2.0
        return out

    return logits


def _search(tok, vocab, seed, width, alternatives):
    search = BeamSearch(tok, width, max_tokens=6, stop=("\n",), alternatives=alternatives)
    model = _toy(tok, vocab, seed)
    feed = search.step(model([])[None])
    steps = 1
    while feed is not None:
        feed = search.step(torch.stack([model(h.tokens) for h in search.live]))
        steps += 1
    return search, steps


def _text(tok, tokens):
    return tok.decode(tokens).split("\n", 1)[0]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("width", [1, 2, 4])
def test_alternatives_leave_the_answer_alone_and_are_the_next_best_distinct_lines(
    shipped, seed, width
):
    model, tok = shipped
    vocab = model.config.vocab_size
    alone, steps_alone = _search(tok, vocab, seed, width, 0)
    search, steps = _search(tok, vocab, seed, width, 2)
    assert search.answer() == alone.answer() and alone.alternatives() == []
    assert steps >= steps_alone  # the search may only go on longer
    best = search.best
    found = search.alternatives()
    assert len(found) <= 2
    texts = [_text(tok, search.answer())] + [_text(tok, t) for t in found]
    assert len(set(texts)) == len(texts) and all(t.strip() for t in texts)
    # Best first, none further than the margin below the answer.
    by_tokens = {tuple(h.tokens): h.score for h in search.finished.values()}
    scores = [by_tokens[tuple(t)] for t in found]
    assert scores == sorted(scores, reverse=True)
    assert all(best.score - ALTERNATIVE_MARGIN <= s <= best.score for s in scores)


def test_the_next_likeliest_lines_come_in_order(shipped):
    model, tok = shipped
    v = model.config.vocab_size
    ids = {p: tok.encode(p)[0] for p in ("x", "y", "z", "\n")}

    def dist(**p):
        out = torch.full((v,), -40.0)
        for k, value in p.items():
            out[ids[{"nl": "\n"}.get(k, k)]] = torch.tensor(value).log()
        return out

    search = BeamSearch(tok, 3, max_tokens=4, stop=("\n",), alternatives=2)
    search.step(dist(x=0.5, y=0.3, z=0.2)[None])
    # Each line ends now: "x" (0.5), "y" (0.3), "z" (0.2); nothing else is as likely.
    search.step(torch.stack([dist(nl=1.0), dist(nl=1.0), dist(nl=1.0)]))
    assert search.done
    assert _text(tok, search.answer()) == "x"
    assert [_text(tok, t) for t in search.alternatives()] == ["y", "z"]
    # One alternative asked for: only the second line.
    one = BeamSearch(tok, 3, max_tokens=4, stop=("\n",), alternatives=1)
    one.step(dist(x=0.5, y=0.3, z=0.2)[None])
    one.step(torch.stack([dist(nl=1.0), dist(nl=1.0), dist(nl=1.0)]))
    assert [_text(tok, t) for t in one.alternatives()] == ["y"]


def test_n_is_checked_on_admission_and_on_the_wire():
    for n in (0, MAX_COMPLETIONS + 1):
        with pytest.raises(BadRequest):
            check_request(Request([5], n=n), context_length=64)
    check_request(Request([5], n=MAX_COMPLETIONS), context_length=64)
    for bad in (0, MAX_COMPLETIONS + 1, True, 2.0, "3"):
        with pytest.raises(ValueError):
            CompletionParams.from_params({"prefix": "x", "n": bad})
    assert CompletionParams.from_params({"prefix": "x", "n": 3}).n == 3
    assert FEATURE_N in FEATURES


# -- through the engine and the daemon -------------------------------------------------------------

PREFIX = (
    "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n"
    "        return [line.rstrip() for line in f]\n\n\n"
    'def write_lines(path, lines):\n    with open(path, "w") as f:\n        '
)
SUFFIX = '\n\n\ndef main():\n    lines = read_lines("in.txt")\n    write_lines("out.txt", lines)\n'


def _run(model, tok, **request):
    prompt = build_fim_prompt(tok, PREFIX, SUFFIX, "spm", heal=True)
    req = Request(
        prompt, max_tokens=24, stop=("\n",), forced_text=healed_text(tok, PREFIX), **request
    )
    return Engine(model, tok).complete(req).check()


def test_the_engine_returns_the_same_answer_and_distinct_alternatives(shipped):
    model, tok = shipped
    one = _run(model, tok, beams=2)
    several = _run(model, tok, beams=2, n=4)
    assert several.text == one.text and one.alternatives == []
    assert several.alternatives, "the search finished no other line here"
    texts = [several.text, *several.alternatives]
    assert len(set(texts)) == len(texts) <= 4
    assert all(t.strip() and "\n" not in t for t in texts)
    # Where no beam search runs (greedy, sampling) there are none.
    assert _run(model, tok, n=4).alternatives == []
    assert _run(model, tok, beams=2, n=4, temperature=0.7, seed=3).alternatives == []


async def test_the_daemon_sends_the_alternatives_in_the_result(tmp_path, monkeypatch):
    monkeypatch.setenv("WD_ENGINE_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    client = EngineClient(
        spawn=SpawnConfig(model=str(default_model_dir()), extra_args=["--idle-timeout", "60"])
    )
    info = await client.connect()
    try:
        assert FEATURE_N in info["features"]
        params = dict(prefix=PREFIX, suffix=SUFFIX, max_tokens=24, stop=["\n"], beams=2)
        stream = await client.complete(dict(params, n=4))
        text = "".join([d async for d in stream])
        alternatives = stream.result["alternatives"]
        assert alternatives and all(isinstance(a, str) and a.strip() for a in alternatives)
        assert text not in alternatives and len(set(alternatives)) == len(alternatives) <= 3
        stream = await client.complete(params)
        assert "".join([d async for d in stream]) == text
        assert "alternatives" not in stream.result  # one asked for: none sent
    finally:
        await client.request("shutdown", timeout=10)
        await client.close()
