"""Streaming, stopping and sampling, through the engine as `wd-engine generate` runs it."""

import io
import os
import subprocess
import sys

import pytest
import torch
from engine_runs import complete

from engine.core.engine import Engine
from engine.core.request import (
    BadRequest,
    ContextExceeded,
    EmptyPrompt,
    Request,
    RequestFailed,
    check_request,
    token_budget,
)
from engine.decoding.sampling import sample
from engine.decoding.stops import StopMatcher
from engine.ipc.protocol import MAX_BEAMS, ErrorCode
from engine.loading.loader import load_model
from engine.loading.tokenizer import REPLACEMENT_CHAR, Tokenizer
from engine.prompts.fim import FimUnsupported, build_fim_prompt


@pytest.fixture(scope="module")
def tiny(checkpoint_factory):
    path = checkpoint_factory()
    return load_model(path), Tokenizer.from_dir(path)


def test_stream_decoder_never_splits_a_character(tiny):
    _, tokenizer = tiny
    text = "naïve café — “quotes” 你好 🙂🙂 done\n"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text) // 4  # multi-byte characters span several byte-level tokens
    decoder = tokenizer.stream_decoder()
    deltas = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(deltas) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_stop_matcher_cuts_across_deltas_and_holds_back_partial_stops():
    m = StopMatcher(["\n\n", "END"])
    out = [m.feed("abc\n"), m.feed("x E"), m.feed("N"), m.feed("D more")]
    assert "".join(out) == "abc\nx "
    assert out[0] == "abc"  # "\n" might start "\n\n": held back until resolved
    assert m.stopped and m.feed("later") == ""
    m2 = StopMatcher(["END"])
    assert m2.feed("EN") == "" and m2.flush() == "EN"


def test_stop_strings_and_max_tokens(tiny):
    model, tokenizer = tiny
    ids = tokenizer.encode("def add(a, b):\n")
    full, stats = complete(model, tokenizer, ids, max_tokens=24, stop_at_eos=False)
    assert stats.finish_reason == "length" and stats.completion_tokens == 24
    assert len(full) >= 2
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut, stats = complete(model, tokenizer, ids, max_tokens=24, stop=[stop], stop_at_eos=False)
    assert stats.finish_reason == "stop"
    assert cut == full[: full.find(stop)]


def test_streamed_deltas_concatenate_to_the_text(tiny):
    model, tokenizer = tiny
    request = Request(
        tokenizer.encode("for i in"), max_tokens=16, temperature=0.8, seed=3, stop_at_eos=False
    )
    engine = Engine.for_one_request(model, tokenizer, request)
    deltas = []
    done = engine.complete(request, lambda e: deltas.append(e.text) if e.kind == "delta" else None)
    assert deltas and "".join(deltas) == done.text
    assert done.usage["first_token_ms"] > 0 and done.usage["prefill_ms"] > 0
    assert len(done.token_ids) == done.completion_tokens == 16


def test_seeded_sampling_is_reproducible(tiny):
    model, tokenizer = tiny
    ids = tokenizer.encode("class Point:")
    a, _ = complete(model, tokenizer, ids, max_tokens=16, temperature=1.0, top_p=0.9, seed=11)
    b, _ = complete(model, tokenizer, ids, max_tokens=16, temperature=1.0, top_p=0.9, seed=11)
    assert a == b


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    seen = {int(sample(logits, 1.0, 0.7, g)) for _ in range(300)}
    assert seen == {0, 1}
    assert int(sample(logits, 0.0)) == 0


def test_fim_orders(tiny):
    _, tokenizer = tiny
    pre, suf, mid = (
        tokenizer.token_id(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    )
    a, b = tokenizer.encode("def f("), tokenizer.encode("):\n")
    assert build_fim_prompt(tokenizer, "def f(", "):\n", "psm") == [pre, *a, suf, *b, mid]
    assert build_fim_prompt(tokenizer, "def f(", "):\n", "spm") == [suf, *b, pre, *a, mid]


def test_fim_without_tokens_is_a_clear_error():
    from tokenizers import Tokenizer as HF
    from tokenizers import models

    backend = HF(models.BPE(vocab={"a": 0}, merges=[]))
    with pytest.raises(FimUnsupported, match="no FIM tokens"):
        build_fim_prompt(Tokenizer(backend), "a", "a")


def test_prompt_too_long_empty_or_too_many_beams_are_refused_by_code(tiny):
    model, tokenizer = tiny
    context = model.config.max_position_embeddings
    cases = [
        ([5] * context, {}, ErrorCode.CONTEXT_EXCEEDED, ContextExceeded),
        ([], {}, ErrorCode.BAD_REQUEST, EmptyPrompt),
        ([5], {"beams": MAX_BEAMS + 1}, ErrorCode.BAD_REQUEST, BadRequest),
    ]
    for ids, args, code, refusal in cases:
        _, done = complete(model, tokenizer, ids, **args)
        assert done.code == code and done.finish_reason is None
        with pytest.raises(RequestFailed) as failed:
            done.check()
        assert failed.value.code == code
        with pytest.raises(refusal):
            check_request(Request(ids, **args), context)
    # With room for one new token the prompt runs, and ends at the context ("length").
    text, done = complete(model, tokenizer, [5] * (context - 1), max_tokens=8)
    assert done.check().finish_reason in ("length", "eos") and done.completion_tokens <= 1


def test_a_prompt_longer_than_the_context_has_no_negative_budget():
    budget = token_budget(Request([5] * 20, forced_text="abc"), context_length=16)
    assert (budget.forced, budget.completion) == (0, 0)
    budget = token_budget(Request([5] * 10, forced_text="abc", max_tokens=8), context_length=16)
    assert (budget.forced, budget.completion) == (3, 3)


class _ClosedAfter(io.StringIO):
    """Standard output whose reader goes after `size` characters (`| head -c size`)."""

    def __init__(self, size: int, fd: int):
        super().__init__()
        self.size, self.fd = size, fd

    def write(self, text: str) -> int:
        if self.tell() + len(text) > self.size:
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(text)

    def fileno(self) -> int:
        return self.fd


def test_generate_cancels_its_request_when_its_reader_goes(
    checkpoint_factory, monkeypatch, tmp_path
):
    from engine import cli

    finished = []
    complete = Engine.complete
    monkeypatch.setattr(
        Engine, "complete", lambda *a, **k: finished.append(complete(*a, **k)) or finished[-1]
    )
    with open(tmp_path / "stdout", "w") as file:
        monkeypatch.setattr(sys, "stdout", _ClosedAfter(3, file.fileno()))
        argv = ["generate", "--model", str(checkpoint_factory()), "--prompt", "def f(x):"]
        argv += ["--max-tokens", "200", "--temperature", "1", "--seed", "1"]
        assert cli.main(argv) == 1
    (done,) = finished
    assert done.finish_reason == "cancelled" and done.completion_tokens < 200


def test_generate_exits_quietly_when_its_reader_goes(checkpoint_factory):
    """`wd-engine generate ... | head -c 3`: exit 1, as an unhandled EPIPE would, without a
    traceback (the reader is gone before the first text, so this never races the completion)."""
    read, write = os.pipe()
    os.close(read)
    command = [sys.executable, "-m", "engine.cli", "generate", "--model", str(checkpoint_factory())]
    command += ["--prompt", "def f(x):", "--max-tokens", "400", "--temperature", "1", "--seed", "1"]
    try:
        result = subprocess.run(command, stdout=write, stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write)
    err = result.stderr.decode()
    assert result.returncode == 1, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "callback failed" not in err
