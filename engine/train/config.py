"""The default model's architecture, written as a Qwen3-MoE `config.json` in the same key style
as the real Qwen3-Coder checkpoints (`num_experts`, `rope_theta`, `torch_dtype`)."""

from __future__ import annotations

import json
from pathlib import Path

# Sized for the 48 MB package budget (about 23M params in bf16, embeddings tied) and for a 2-core
# CPU: about 6M active params per token, so a single-line suggestion decodes quickly there.
# `train --widen-experts` grows the experts of a trained model (engine/train/grow.py); export
# writes the width its checkpoint has, and FP8 export (`--fp8-block`) halves the projections' bytes.
# These are the first model's sizes; wd-coder-tiny (run 7) has 384-wide experts in FP8, and the
# default, wd-coder-small, its own shape (its config.json; engine.bench.cpu_shapes).
CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 16000,
    "hidden_size": 320,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    # The training rows' length: export writes what a model trained on.
    "max_position_embeddings": 1024,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "intermediate_size": 1024,  # dense MLP size; unused because every layer is MoE
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "initializer_range": 0.02,
    "use_cache": True,
    "bos_token_id": None,
    "eos_token_id": 0,
    "pad_token_id": 4,
    "torch_dtype": "bfloat16",
}

GENERATION_CONFIG = {
    "bos_token_id": None,
    "eos_token_id": 0,
    "pad_token_id": 4,
    "do_sample": False,
    "max_new_tokens": 64,
}


def write_configs(out: Path, config: dict = CONFIG) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")


def load_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(
        description="Write config.json and generation_config.json into a model folder."
    )
    ap.add_argument("--out", type=Path, required=True)
    write_configs(ap.parse_args().out)
