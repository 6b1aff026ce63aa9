"""Token healing at the cursor: the prompt leaves out the end of the prefix, decoding is
constrained to write it again, and the output does not repeat it."""

import random

import pytest
import torch
from engine_runs import complete, small_engine

from engine.core.output import OutputAssembler
from engine.core.request import Request
from engine.decoding.token_healing import Forcing, token_healer
from engine.loading.loader import load_model
from engine.loading.tokenizer import Tokenizer
from engine.model.options import ModelOptions
from engine.models import default_model_dir
from engine.prompts.fim import build_fim_prompt, healed_text

STACK = (
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, item):\n        "
)
STACK_SUFFIX = "\n\n    def pop(self):\n        return self.items.pop()\n"


@pytest.fixture(scope="module")
def shipped():
    d = default_model_dir()
    return load_model(d), Tokenizer.from_dir(d)


def test_split_keeps_the_text_and_heals_indentation_or_the_last_token(shipped):
    _, tok = shipped
    healer = token_healer(tok)
    assert healer.supported
    cases = {
        STACK: "        ",
        STACK + "self.items.app": None,
        "x = foo(": None,
        "é": None,
        "a\n": "",
        "    ": "    ",
        "": "",
        "def f():\n        \n": "",
    }
    for prefix, expected in cases.items():
        ids, forced = healer.split(prefix)
        assert tok.decode(ids) + forced == prefix
        if expected is not None:
            assert forced == expected
        elif prefix:
            assert forced and forced == tok.decode(tok.encode(prefix)[-1:])  # the last token's text
    rng = random.Random(0)
    for _ in range(200):  # random text, unicode included: nothing is lost or added
        prefix = "".join(rng.choice("ab \n\t(é_.:'\"0") for _ in range(rng.randint(0, 30)))
        ids, forced = healer.split(prefix)
        assert tok.decode(ids) + forced == prefix


def test_forcing_only_lets_through_tokens_that_write_the_text(shipped):
    _, tok = shipped
    healer = token_healer(tok)
    gen = torch.Generator().manual_seed(0)
    for text in ("        ", "ite", "\n    ", "(", "é"):
        forcing, written = Forcing(healer, text), b""
        for _ in range(len(text.encode()) + 1):
            if not forcing.active:
                break
            logits = torch.randn(tok.vocab_size, generator=gen)
            token = int(forcing.mask(logits).argmax())
            piece = healer.token_bytes[token]
            assert piece and (
                piece.startswith(forcing.remaining) or forcing.remaining.startswith(piece)
            )
            written += piece
            forcing.advance(token)
        assert not forcing.active and written.startswith(text.encode())
        # The constraint keeps the best allowed token: with one allowed token boosted, it wins.
        forcing, logits = Forcing(healer, text), torch.randn(tok.vocab_size, generator=gen)
        allowed = healer.allowed(text.encode(), deeper=bool(text.strip(" \t")))
        best = int(allowed[logits[allowed].argmax()])
        assert int(forcing.mask(logits).argmax()) == best


def test_healed_indentation_never_grows_deeper(shipped):
    """The editor put the cursor at this depth: neither a longer whitespace token nor whitespace
    right after the indentation gets through, and after that token decoding is free again."""
    _, tok = shipped
    healer = token_healer(tok)
    ids_of = {
        healer.token_bytes[i]: i for i in range(len(healer.token_bytes)) if healer.token_bytes[i]
    }
    four, eight = ids_of[b"    "], ids_of[b"        "]
    forcing = Forcing(healer, "    ")
    logits = torch.zeros(tok.vocab_size)
    logits[eight], logits[four] = 10.0, 5.0  # the model would rather indent deeper
    assert int(forcing.mask(logits).argmax()) == four
    forcing.advance(four)
    assert forcing.active and not forcing.remaining  # one more step: no whitespace
    guarded = forcing.mask(logits)
    starts_blank = [i for b, i in ids_of.items() if b[:1] in (b" ", b"\t")]
    assert torch.isinf(guarded[starts_blank]).all() and guarded[ids_of[b"return"]] == 0
    forcing.advance(ids_of[b"return"])
    assert not forcing.active
    # A token that writes the indentation and goes on with code ends it at once.
    forcing = Forcing(healer, " ")
    assert forcing.mask(logits)[ids_of[b" return"]] == 0
    forcing.advance(ids_of[b" return"])
    assert not forcing.active


def test_forced_text_is_neither_released_nor_matched_against_stops(shipped):
    _, tok = shipped
    ids = tok.encode("\n        return x\n    y")
    out = OutputAssembler(tok, max_tokens=20, stop=["\n"], skip_text="\n        ")
    text = "".join(out.push(i) for i in ids)
    assert text == "return x" and out.finish_reason == "stop"


def test_mid_word_completion_continues_the_word(shipped):
    model, tok = shipped
    prefix = STACK + "self.items.app"
    ids = build_fim_prompt(tok, prefix, STACK_SUFFIX, "spm", heal=True)
    text, stats = complete(
        model, tok, ids, max_tokens=24, stop=["\n"], forced_text=healed_text(tok, prefix)
    )
    assert text == "end(item)"
    assert tok.decode(stats.token_ids).startswith(healed_text(tok, prefix))
    # At the indentation of an empty line: the line's code, without the indentation again.
    ids = build_fim_prompt(tok, STACK, STACK_SUFFIX, "spm", heal=True)
    text, _ = complete(
        model, tok, ids, max_tokens=24, stop=["\n"], forced_text=healed_text(tok, STACK)
    )
    assert text == "self.items.append(item)"


def test_engine_and_single_generation_heal_alike(checkpoint_factory):
    path = checkpoint_factory()
    # The batch decodes on the general path, a lone generation on the lean one: in fp32 they
    # differ in rounding alone (int8 lean steps can flip a random model's near-ties).
    model = load_model(path, options=ModelOptions(lean_weights="fp32"))
    tok = Tokenizer.from_dir(path)
    engine = small_engine(model, tok)
    prefixes = ["def add(a, b):\n    ", "import o", "for i in range(", "x = [1, 2, 3]\nprint(x"]
    results = {}
    for i, prefix in enumerate(prefixes):  # batched, each with its own constraint
        results[i] = []
        ids = build_fim_prompt(tok, prefix, "\n", "spm", heal=True)
        engine.submit(
            Request(ids, max_tokens=10, stop_at_eos=False, forced_text=healed_text(tok, prefix)),
            results[i].append,
        )
    engine.run_until_idle()
    for i, prefix in enumerate(prefixes):
        forced = healed_text(tok, prefix)
        assert forced
        ids = build_fim_prompt(tok, prefix, "\n", "spm", heal=True)
        expected, stats = complete(
            model, tok, ids, max_tokens=10, stop_at_eos=False, forced_text=forced
        )
        assert "".join(e.text for e in results[i] if e.kind == "delta") == expected
        assert tok.decode(stats.token_ids).startswith(forced)


def test_forced_tokens_do_not_count_against_the_budget(checkpoint_factory):
    path = checkpoint_factory()
    model, tok = load_model(path), Tokenizer.from_dir(path)
    engine = small_engine(model, tok)
    for prefix in ("x = 1\n   \t  ", "print('caf"):  # several forced tokens; a mid-word cursor
        forced = healed_text(tok, prefix)
        assert forced
        ids = build_fim_prompt(tok, prefix, "\n", "spm", heal=True)
        for max_tokens in (1, 2):
            events = []
            engine.submit(
                Request(ids, max_tokens=max_tokens, stop_at_eos=False, forced_text=forced),
                events.append,
            )
            engine.run_until_idle()
            text = "".join(e.text for e in events if e.kind == "delta")
            done = events[-1]
            assert done.finish_reason == "length" and done.usage["completion_tokens"] == max_tokens
            expected, stats = complete(
                model, tok, ids, max_tokens=max_tokens, stop_at_eos=False, forced_text=forced
            )
            assert (
                text == expected
                and stats.completion_tokens == max_tokens
                and stats.forced_tokens >= 1
            )
            assert tok.decode(stats.token_ids).startswith(
                forced + text
            )  # released text follows the forced


def test_whitespace_alone_is_forced_only_as_indentation(shipped):
    """A space typed after code backs off into the code, so the depth guard (which keys on
    whitespace-only forced text) never stops an inline comment after `x = {} `."""
    _, tok = shipped
    healer = token_healer(tok)
    for prefix in ("x = ", "cache: dict[int, bytes] = {} ", "foo(a,  ", "    return "):
        ids, forced = healer.split(prefix)
        assert forced.strip() and tok.decode(ids) + forced == prefix
        forcing = Forcing(healer, forced)
        while forcing.remaining:  # write exactly the forced text, in one or more tokens
            token = next(
                i
                for i in healer.allowed(forcing.remaining).tolist()
                if forcing.remaining.startswith(healer.token_bytes[i])
            )
            forcing.advance(token)
        assert not forcing.active  # no guard step: " # comment" may follow
    rng = random.Random(1)
    for _ in range(300):
        prefix = "".join(rng.choice("ab \n\t(=_.:#") for _ in range(rng.randint(1, 30)))
        _, forced = healer.split(prefix)
        if forced and not forced.strip():
            assert not prefix[
                prefix.rfind("\n") + 1 :
            ].strip()  # the cursor line is only indentation
