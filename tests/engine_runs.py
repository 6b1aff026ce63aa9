"""Requests through the engine, as tests run them."""

from __future__ import annotations

from engine.core.engine import Engine
from engine.core.options import EngineOptions
from engine.core.request import Completion, Request


def small_engine(model, tokenizer, **options) -> Engine:
    """An engine of 64 blocks of 8 tokens (other options as given): small enough that tests
    reach its limits."""
    return Engine(
        model, tokenizer, EngineOptions(**dict(dict(num_blocks=64, block_size=8), **options))
    )


def complete(model, tokenizer, prompt_ids, **request) -> tuple[str, Completion]:
    """One request on a fresh engine whose pool holds just it (nothing cached), as
    `wd-engine generate` runs it: its text and its gathered events."""
    req = Request(list(prompt_ids), **request)
    done = Engine.for_one_request(model, tokenizer, req).complete(req)
    return done.text, done
