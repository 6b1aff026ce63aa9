"""Completion prompt layout: budgets, suffix-first order for cache warmth, repository context."""

import json

import pytest

from engine.prompt_layout import ContextChunk, build_completion_prompt, supported_fim_orders, uses_repo_context
from engine.tokenizer import Tokenizer


def _tok(checkpoint_factory):
    return Tokenizer.from_dir(checkpoint_factory())


def test_spm_typing_only_appends(checkpoint_factory):
    tok = _tok(checkpoint_factory)
    prefix, suffix = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self", "):\n        pass\n"
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
    without = tok.decode(build_completion_prompt(tok, "a = ", "\n", [chunk], path="main.py", repo_context=False))
    assert "util.py" in with_ctx and "main.py" in with_ctx
    assert "util.py" not in without and "<|file_sep|>" not in without
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"repo_context": True, "fim_orders": ["psm", "spm"]}))
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
def test_a_prefix_over_budget_loses_whole_lines_in_steps_that_stay_put_while_typing(checkpoint_factory, heal):
    from engine.prompt_layout import PREFIX_CUT_LINES

    tok = _tok(checkpoint_factory)
    prefix = "".join(f"v{i} = {i}\n" for i in range(800)) + "result = v3"
    suffix = "\nprint(result)\n"
    prompts = [build_completion_prompt(tok, prefix + typed, suffix, order="spm", max_prompt_tokens=600, heal=heal)
               for typed in ("", "9", "9 ", "9 +")]
    assert all(len(ids) <= 600 for ids in prompts)
    dropped = _kept_lines(tok, prompts[0], prefix) if not heal else None
    if dropped is not None:
        assert dropped % PREFIX_CUT_LINES == 0  # short lines: whole steps
        one_less = "".join(prefix.splitlines(keepends=True)[dropped - PREFIX_CUT_LINES:])
        assert len(build_completion_prompt(tok, one_less, suffix, order="spm", max_prompt_tokens=10**6)) > 600
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
    ids = build_completion_prompt(tok, "y = '" + "z" * 5000, "\n", order="spm", max_prompt_tokens=300)
    assert len(ids) == 300
