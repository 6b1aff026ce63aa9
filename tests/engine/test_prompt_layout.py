"""Completion prompt layout: budgets, suffix-first order for cache warmth, repository context."""

import json

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


def test_a_prefix_over_budget_is_cut_at_a_line_step_that_stays_put_while_typing(checkpoint_factory):
    from engine.prompt_layout import PREFIX_CUT_LINES

    tok = _tok(checkpoint_factory)
    prefix = "".join(f"values_{i} = [{i}, {i * 7}, {i * 13}]\n" for i in range(400)) + "result = values_3"
    suffix = "\nprint(result)\n"
    prompts = [build_completion_prompt(tok, prefix + typed, suffix, order="spm", max_prompt_tokens=600)
               for typed in ("", "9", "9 ", "9 +")]
    for ids in prompts:
        assert len(ids) <= 600
    text = tok.decode(prompts[0])
    first_line = text.split("<|fim_prefix|>")[1].split("\n")[0]
    kept = prefix.split("\n").index(first_line)
    assert kept % PREFIX_CUT_LINES == 0 and kept > 0  # whole lines, in steps
    # typing only appends: the prompts share all but their last few tokens
    for before, after in zip(prompts, prompts[1:]):
        common = next((i for i, (x, y) in enumerate(zip(before, after)) if x != y), len(before))
        assert common >= len(before) - 3
    # the fewest steps that fit: one step less would not
    one_less = "".join(prefix.splitlines(keepends=True)[kept - PREFIX_CUT_LINES:])
    assert len(build_completion_prompt(tok, one_less, suffix, order="spm", max_prompt_tokens=10**6)) > 600
