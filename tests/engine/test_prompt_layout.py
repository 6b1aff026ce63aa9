"""Completion prompt layout: budgets, suffix-first order for cache warmth, repository context."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.loading.tokenizer import Tokenizer
from engine.prompts.layout import (
    ContextChunk,
    build_completion_prompt,
    supported_fim_orders,
    uses_repo_context,
)


def _tok(checkpoint_factory):
    return Tokenizer.from_dir(checkpoint_factory())


def test_spm_typing_only_appends(checkpoint_factory):
    tok = _tok(checkpoint_factory)
    prefix, suffix = (
        "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self",
        "):\n        pass\n",
    )
    before = build_completion_prompt(tok, prefix, suffix, order="spm")
    after = build_completion_prompt(tok, prefix + ",", suffix, order="spm")
    common = next((i for i, (x, y) in enumerate(zip(before, after)) if x != y), len(before))
    assert common >= len(before) - 3  # only the tail near the cursor changes


def test_budget_keeps_prefix_end_and_suffix_start(checkpoint_factory):
    tok = _tok(checkpoint_factory)
    prefix = "".join(f"x{i} = {i}\n" for i in range(300))
    suffix = "".join(f"y{i} = {i}\n" for i in range(300))
    ids = build_completion_prompt(tok, prefix, suffix, max_prompt_tokens=200, max_suffix_tokens=50)
    assert len(ids) <= 200
    text = tok.decode(ids)
    assert "x299 = 299" in text and "y0 = 0" in text and "x0 = 0\n" not in text


def test_repo_context_only_for_models_trained_with_it(checkpoint_factory, tmp_path):
    tok = _tok(checkpoint_factory)
    chunk = ContextChunk("util.py", "def helper():\n    return 42\n")
    with_ctx = tok.decode(build_completion_prompt(tok, "a = ", "\n", [chunk], path="main.py"))
    without = tok.decode(
        build_completion_prompt(tok, "a = ", "\n", [chunk], path="main.py", repo_context=False)
    )
    assert "util.py" in with_ctx and "main.py" in with_ctx
    assert "util.py" not in without and "<|file_sep|>" not in without
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"repo_context": True, "fim_orders": ["psm", "spm"]})
    )
    assert uses_repo_context(tmp_path) and supported_fim_orders(tmp_path) == ("psm", "spm")
    assert not uses_repo_context(checkpoint_factory())  # no <|repo_name|> token, no declaration


def test_special_token_text_in_a_file_is_plain_text(checkpoint_factory):
    tok = _tok(checkpoint_factory)
    ids = tok.encode("x = '<|fim_middle|>'")
    assert tok.token_id("<|fim_middle|>") not in ids
    assert tok.decode(ids) == "x = '<|fim_middle|>'"


def _kept_lines(tok, ids, prefix):
    """How many of the prefix's first lines the prompt left out (it must start at a line start)."""
    kept = tok.decode(ids).split("<|fim_prefix|>")[1].removesuffix("<|fim_middle|>")
    assert prefix.endswith(kept)
    dropped = prefix[: len(prefix) - len(kept)]
    assert dropped.endswith("\n")
    return dropped.count("\n")


@pytest.mark.parametrize("heal", [False, True])
def test_a_prefix_over_budget_loses_whole_lines_in_steps_that_stay_put_while_typing(
    checkpoint_factory, heal
):
    from engine.prompts.layout import PREFIX_CUT_LINES

    tok = _tok(checkpoint_factory)
    prefix = "".join(f"v{i} = {i}\n" for i in range(800)) + "result = v3"
    suffix = "\nprint(result)\n"
    prompts = [
        build_completion_prompt(
            tok, prefix + typed, suffix, order="spm", max_prompt_tokens=600, heal=heal
        )
        for typed in ("", "9", "9 ", "9 +")
    ]
    assert all(len(ids) <= 600 for ids in prompts)
    dropped = _kept_lines(tok, prompts[0], prefix) if not heal else None
    if dropped is not None:
        assert dropped % PREFIX_CUT_LINES == 0  # short lines: whole steps
        one_less = "".join(prefix.splitlines(keepends=True)[dropped - PREFIX_CUT_LINES :])
        assert (
            len(
                build_completion_prompt(tok, one_less, suffix, order="spm", max_prompt_tokens=10**6)
            )
            > 600
        )
    assert len(prompts[0]) >= 600 * 3 // 4  # a step leaves at most a quarter of the room unused
    for before, after in zip(prompts, prompts[1:]):  # typing only appends
        common = next((i for i, (x, y) in enumerate(zip(before, after)) if x != y), len(before))
        assert common >= len(before) - 3


def test_long_lines_are_cut_one_by_one_within_a_step(checkpoint_factory):
    tok = _tok(checkpoint_factory)
    prefix = "".join(f"row_{i} = '{'x' * 150}'\n" for i in range(40)) + "total = "
    ids = build_completion_prompt(tok, prefix, "\n", order="spm", max_prompt_tokens=600)
    assert 600 * 3 // 4 <= len(ids) <= 600
    assert _kept_lines(tok, ids, prefix) % 16 != 0  # not a whole step: single lines gave room back
    # a prefix whose cursor line alone is too long is cut at an exact count
    ids = build_completion_prompt(
        tok, "y = '" + "z" * 5000, "\n", order="spm", max_prompt_tokens=300
    )
    assert len(ids) == 300


# -- long lines, huge prefixes, tokenizers without a size bound ------------------------------------
def _embedded_tokenizer():
    from engine.models import default_model_dir

    return Tokenizer.from_dir(default_model_dir())


@pytest.mark.parametrize(
    "text",
    [
        "x = compute(1, 2); " * 5300,  # one line of 100K characters
        "def f():\n" + "ab" * 100_000 + "\nreturn 1\n",  # a 200K-character word between short lines
        "a" * 200_000,
    ],
)
def test_a_plain_prompt_with_a_long_line_gets_the_ids_of_the_whole_text(text):
    from engine.prompts.layout import PIECE_CHARS, plain_prompt_ids

    tok = _embedded_tokenizer()
    assert max(map(len, text.split("\n"))) > PIECE_CHARS  # longer than a piece: never cut inside
    assert plain_prompt_ids(tok, text, 10**6) == tok.encode_prompt(text)


@pytest.mark.parametrize("line", ["\n", "x\n"])
def test_an_8_mb_prefix_of_short_lines_costs_memory_by_the_budget_not_by_its_lines(line):
    """Lines that cannot fit by their size are counted, never split out: the peak RSS of the
    build, in a fresh process, stays small (splitting 8 MB of newlines took some 370 MB)."""
    script = f"""
from engine.models import default_model_dir
from engine.prompts.layout import layout_completion_prompt
from engine.loading.tokenizer import Tokenizer

def peak_mb():
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024

tok = Tokenizer.from_dir(default_model_dir())
layout_completion_prompt(tok, "x = 1\\n" * 5000 + "y = ", "\\n", max_prompt_tokens=900, heal=True)
prefix = {line!r} * (8_000_000 // {len(line)}) + "total = "
before = peak_mb()
ids, forced = layout_completion_prompt(tok, prefix, "\\n", max_prompt_tokens=900, heal=True)
print(len(ids), peak_mb() - before)
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[2],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.split()
    tokens, grew_mb = int(out[0]), float(out[1])
    print(f"\n8 MB prefix of {line!r} lines: {tokens} tokens, peak RSS +{grew_mb:.0f} MB")
    assert 600 < tokens <= 900
    assert grew_mb < 64


def spm_prompt(tok, prefix):
    return build_completion_prompt(tok, prefix, "\n", order="spm", max_prompt_tokens=600)


def test_the_prefix_cut_is_the_same_whether_or_not_far_lines_are_dropped_by_size(
    checkpoint_factory,
):
    """Dropping the out-of-reach head by its size keeps the line count: the cut steps stay where
    they were, so the prompt start does not move while the user types."""
    from engine.prompts.layout import PREFIX_CUT_LINES

    tok = _tok(checkpoint_factory)
    far = "".join(f"v{i} = {i}\n" for i in range(20_000))  # most of it cannot fit by its size
    for typed in ("r", "re", "res"):
        ids = spm_prompt(tok, far + typed)
        assert _kept_lines(tok, ids, far + typed) % PREFIX_CUT_LINES == 0
    first, last = (spm_prompt(tok, far + t) for t in ("r", "res"))
    assert last[: len(first) - 3] == first[: len(first) - 3]


@pytest.mark.parametrize("heal", [False, True])
def test_the_forced_text_is_the_healed_text_of_the_prefix_when_lines_are_cut(
    checkpoint_factory, heal
):
    from engine.prompts.fim import healed_text
    from engine.prompts.layout import layout_completion_prompt

    tok = _tok(checkpoint_factory)
    for cursor in ("    ", "    return a", "x = 1\n", "print(i"):
        prefix = "".join(f"v{i} = {i}\n" for i in range(500)) + cursor
        ids, forced = layout_completion_prompt(tok, prefix, "\n", max_prompt_tokens=300, heal=heal)
        assert len(ids) <= 300
        assert forced == (healed_text(tok, prefix) if heal else "")
    # With no room for the prefix at all, nothing of it is in the prompt, nor written again.
    ids, forced = layout_completion_prompt(
        tok, "x = 1\nprint(i", "y" * 5000, max_prompt_tokens=3, heal=True
    )
    assert forced == "" and len(ids) == 3  # the three FIM markers


def _with(backend):
    """The engine's Tokenizer around a `tokenizers` one."""
    from tokenizers import Tokenizer as Backend

    spec = backend.to_str()
    return Tokenizer(Backend.from_str(spec), prompt_backend=Backend.from_str(spec))


def _whitespace_taking_token():
    from checkpoints import build_tokenizer
    from tokenizers import AddedToken

    backend = build_tokenizer()
    backend.add_special_tokens([AddedToken("<|mark|>", lstrip=True, special=True)])
    return backend, " " * 50_000 + "<|mark|>", 1000  # the spaces go into the token


def _stripping_normalizer():
    from checkpoints import build_tokenizer
    from tokenizers import normalizers

    backend = build_tokenizer()
    backend.normalizer = normalizers.Strip()
    return backend, " " * 50_000 + "x = 1", 1000


def _nfkc_normalizer():
    """Long tokens of "A", and mathematical bold A (4 bytes) that NFKC makes "A" (1 byte)."""
    from tokenizers import (
        Tokenizer as Backend,
    )
    from tokenizers import (
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + 8,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(["A" * 64] * 50, trainer)
    backend.normalizer = normalizers.NFKC()
    text = "\U0001d400" * 6400
    return backend, text, len(_with(backend).encode_prompt(text))


@pytest.mark.parametrize(
    "make", [_whitespace_taking_token, _stripping_normalizer, _nfkc_normalizer]
)
def test_a_tokenizer_that_shrinks_text_without_bound_is_not_refused_by_size(make):
    """Where a token may stand for more bytes than any size bound says (a token that takes in
    whitespace; Strip; NFKC, by 4x), the text is tokenized, not refused: it fits its room."""
    from engine.prompts.layout import UNBOUNDED_TEXT_BYTES, max_token_bytes, plain_prompt_ids

    backend, text, room = make()
    tok = _with(backend)
    expected = tok.encode_prompt(text)
    assert len(expected) <= room
    assert max_token_bytes(tok) is None
    assert plain_prompt_ids(tok, text, room) == expected
    # Memory stays bounded all the same: past a hard cap nothing is tokenized.
    assert plain_prompt_ids(tok, text * (UNBOUNDED_TEXT_BYTES // len(text) + 1), 10**7) is None


def test_a_tokenizer_without_a_size_bound_still_lays_out_huge_prefixes_in_bounded_time():
    from engine.prompts.layout import layout_completion_prompt

    tok = _with(_whitespace_taking_token()[0])
    prefix = "".join(f"value_{i} = compute({i})\n" for i in range(300_000)) + "total = "
    t0 = time.monotonic()
    suffix = "\n" * 3_000_000 + "x"
    ids, forced = layout_completion_prompt(tok, prefix, suffix, max_prompt_tokens=600, heal=True)
    assert 450 <= len(ids) <= 600 and forced
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("normalizer", [None, "NFC", "NFD", "Prepend+Replace"])
def test_the_size_check_stays_for_tokenizers_with_a_bound(checkpoint_factory, normalizer):
    """The embedded model's tokenizer, the test checkpoints', and Qwen's kind (NFC) keep a bound:
    an 8 MB prompt is refused by its size at once."""
    from tokenizers import normalizers

    from engine.prompts.layout import max_token_bytes, plain_prompt_ids

    backend = _tok(checkpoint_factory).backend
    spaces = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.normalizer = {
        None: None,
        "NFC": normalizers.NFC(),
        "NFD": normalizers.NFD(),
        "Prepend+Replace": spaces,
    }[normalizer]
    tok = _with(backend)
    for tokenizer in (tok, _embedded_tokenizer()):
        assert max_token_bytes(tokenizer) is not None
        t0 = time.monotonic()
        assert plain_prompt_ids(tokenizer, "x = compute(1, 2)\n" * 450_000, 1000) is None
        assert time.monotonic() - t0 < 1.0  # by its size: tokenizing would take seconds
