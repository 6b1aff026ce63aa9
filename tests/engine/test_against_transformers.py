"""The engine's logits and greedy tokens against transformers on the same checkpoint."""

import subprocess
import sys

import pytest
import torch
from checkpoints import load_reference
from engine_runs import complete

from engine.loading.loader import load_model
from engine.loading.tokenizer import Tokenizer
from engine.model.options import ModelOptions

PROMPTS = [
    "def add(a, b):\n    return",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "import os\nprint(os.path.join('a', 'b'))\nfor i in range(10):\n    print(",
    "naïve café 你好 🙂 x = 1",
]

VARIANTS = {
    "moe-untied-norm": dict(),
    "moe-tied-nonorm": dict(tie=True, norm_topk_prob=False),
    "dense-layer-mlp-only": dict(mlp_only_layers=(1,)),
    "dense-by-sparse-step": dict(decoder_sparse_step=2, tie=True),
}


def _max_rel(ours, theirs):
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@pytest.mark.parametrize("moe_path", ["expert_centric", "output_centric", "auto"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batch_logits_match_transformers(checkpoint_factory, variant, moe_path):
    path = checkpoint_factory(**VARIANTS[variant])
    model = load_model(path, options=ModelOptions(moe_path=moe_path))
    tokenizer = Tokenizer.from_dir(path)
    reference = load_reference(path)
    rows = [tokenizer.encode(p) for p in PROMPTS]
    width = max(map(len, rows))
    # A ragged batch, right-padded: each row's real tokens must give the same logits as alone.
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    positions = torch.arange(width)[None].expand(len(rows), width)
    logits = model.forward(tokens, positions, model.new_cache(len(rows)))
    for i, row in enumerate(rows):
        with torch.no_grad():
            expected = reference(torch.tensor([row])).logits[0]
        assert _max_rel(logits[i, : len(row)], expected) < 1e-4, (variant, moe_path, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_32_tokens_identical(checkpoint_factory, variant):
    path = checkpoint_factory(**VARIANTS[variant])
    # fp32 decode steps: token for token as transformers, whose arithmetic they share up to
    # rounding (int8 steps can flip a random model's near-ties; see test_lean_matrices).
    model = load_model(path, options=ModelOptions(lean_weights="fp32"))
    tokenizer = Tokenizer.from_dir(path)
    reference = load_reference(path)
    for prompt in PROMPTS[:2]:
        ids = tokenizer.encode(prompt)
        text, stats = complete(model, tokenizer, ids, max_tokens=32, stop_at_eos=False)
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([ids]),
                max_new_tokens=32,
                min_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
            )
        expected = out[0, len(ids) :].tolist()
        assert stats.token_ids == expected
        # A character cut off by the token limit is dropped, not shown as U+FFFD.
        assert text == tokenizer.decode(expected).rstrip("\ufffd")


@pytest.mark.parametrize("form", ["int8", "fp32"])
def test_cli_prints_only_the_completion(checkpoint_factory, form):
    path = checkpoint_factory()
    model = load_model(path, options=ModelOptions(lean_weights=form))
    tokenizer = Tokenizer.from_dir(path)
    ids = tokenizer.encode(PROMPTS[0])
    expected, _ = complete(model, tokenizer, ids, max_tokens=32)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.cli",
            "generate",
            "--model",
            str(path),
            "--prompt",
            PROMPTS[0],
            "--max-tokens",
            "32",
            "--temperature",
            "0",
            "--cpu-decode-weights",
            form,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected
    assert expected  # a random model still writes something in 32 tokens


def test_cli_fim_uses_the_models_fim_tokens(checkpoint_factory):
    path = checkpoint_factory()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.cli",
            "generate",
            "--model",
            str(path),
            "--fim-prefix",
            "def f(",
            "--fim-suffix",
            "):\n    pass\n",
            "--max-tokens",
            "8",
            "--stats",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "prompt" in result.stderr and "tok/s" in result.stderr


def test_sharded_and_bf16_checkpoints_load(checkpoint_factory):
    base = load_model(checkpoint_factory())
    sharded_path = checkpoint_factory(max_shard_size="100KB")
    assert (sharded_path / "model.safetensors.index.json").is_file()
    sharded = load_model(sharded_path)
    tokens = torch.tensor([[5, 9, 42, 7, 100]])
    pos = torch.arange(5)[None]
    assert torch.equal(
        base.forward(tokens, pos, base.new_cache(1)),
        sharded.forward(tokens, pos, sharded.new_cache(1)),
    )

    bf16_path = checkpoint_factory(dtype=torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(bf16_path, dtype=dtype)
        reference = load_reference(bf16_path, dtype=dtype)
        logits = model.forward(tokens, pos, model.new_cache(1))
        with torch.no_grad():
            expected = reference(tokens).logits.float()
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        assert _max_rel(logits[0], expected[0]) < tolerance


def test_cli_refuses_int4_decode_weights_for_a_model_not_trained_through_them(checkpoint_factory):
    """Asked for int4 on a model whose weights are not int4 groups, the command names the
    problem and fails instead of streaming rounded weights."""
    path = checkpoint_factory()
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "generate", "--model", str(path), "--prompt", "x"]
        + ["--max-tokens", "4", "--cpu-decode-weights", "int4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "trained through int4 groups" in result.stderr
    assert "Traceback" not in result.stderr
