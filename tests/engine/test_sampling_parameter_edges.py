"""Edge values of a request's sampling parameters: an unusable seed fails that request alone
(the engine loop goes on, its blocks are freed); a zero budget and a vanishing temperature
behave as their limits say."""

import pytest

from engine.core.engine import Engine
from engine.core.options import EngineOptions
from engine.core.request import Request
from engine.ipc import protocol as P
from engine.loading.loader import load_model
from engine.loading.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def engine(checkpoint_factory):
    path = checkpoint_factory()
    return Engine(
        load_model(path), Tokenizer.from_dir(path), EngineOptions(num_blocks=64, block_size=8)
    )


def run(engine, request):
    events = []
    engine.submit(request, events.append)
    engine.run_until_idle()
    return events


def test_an_unusable_seed_fails_alone_and_frees_its_blocks(engine):
    events = run(engine, Request([5, 6, 7], max_tokens=4, temperature=1.0, seed=2**64))
    assert events[-1].kind == "error"
    assert engine.stats()["blocks_used"] == 0
    assert run(engine, Request([5, 6, 7], max_tokens=3, stop_at_eos=False))[-1].kind == "done"
    with pytest.raises(ValueError, match="seed"):
        P.CompletionParams.from_params({"prompt": "x", "seed": 2**64})


def test_zero_budget_and_tiny_temperature(engine):
    events = run(engine, Request([5, 6, 7], max_tokens=0))
    assert events[-1].kind == "done" and events[-1].usage["completion_tokens"] == 0
    assert not [e for e in events if e.kind == "delta"]
    greedy = run(engine, Request([5, 6, 7], max_tokens=5, stop_at_eos=False))
    tiny = run(
        engine, Request([5, 6, 7], max_tokens=5, temperature=1e-50, stop_at_eos=False, seed=1)
    )
    assert tiny[-1].kind == "done"
    assert "".join(e.text for e in tiny if e.kind == "delta") == "".join(
        e.text for e in greedy if e.kind == "delta"
    )
