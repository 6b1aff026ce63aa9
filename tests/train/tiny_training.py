"""Tiny training models for the FP8 and model-growing tests, and their FP8 exports."""

import pytest
import torch
from checkpoints import quantizable_training_config, scaled_training_model

from engine.train.config import CONFIG

# Projections 48x64, 32x48, 32x48 (experts), 48x32: all multiples of 16.
TINY = {
    **CONFIG,
    "vocab_size": 96,
    "hidden_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}


def tiny_model(config=TINY, seed=0, moe="sparse"):
    return scaled_training_model(config, seed, moe)


# Every projection dim a multiple of EXPORT_BLOCK, which transformers' FP8 loader needs:
# q/o 64x64, k/v 32x64, experts gate/up 32x64, down 64x32.
EXPORT_TINY = quantizable_training_config()
EXPORT_BLOCK = 32


def export_fp8(root, block, config=EXPORT_TINY):
    """A QAT model saved by `checkpoint.save` (in root/run/ckpt) and exported through the CLI with
    --fp8-block; returns (model, model folder). The weights shipped in bf16 (embedding, router,
    norms) are made exact in bf16; the projections stay fp32 values that bf16 cannot hold, so a
    checkpoint that rounded them to bf16 before the export's FP8 rounding would show."""
    from engine.train import checkpoint, export

    model = tiny_model(config, seed=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not all 4.0, so the norms' gains are exercised
                p.copy_(4.0 + torch.randn(p.shape, generator=torch.Generator().manual_seed(9)))
            if not name.endswith("_proj.weight"):
                p.copy_(p.to(torch.bfloat16).float())
    model.set_fp8_training(block)
    model.eval()
    state = {"step": 3, "tokens_seen": 100, "train_seconds": 1.5, "runs": []}
    checkpoint.save(model, state, root / "run" / "ckpt")
    model_dir = root / "model"
    mp = pytest.MonkeyPatch()
    mp.setattr(export, "CONFIG", config)
    try:
        export.main(
            [
                "--ckpt",
                str(root / "run" / "ckpt"),
                "--model-dir",
                str(model_dir),
                "--fp8-block",
                str(block),
            ]
        )
    finally:
        mp.undo()
    return model, model_dir
