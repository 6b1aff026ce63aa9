"""Tiny random Qwen3-MoE checkpoints saved by `transformers`, with a small trained BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

FIM_TOKENS = [
    "<|endoftext|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|file_sep|>",
]

TRAINING_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
    "naïve café ünïcödé — “quotes” 你好 🙂\n",
] * 20


def build_tokenizer(vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=FIM_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    return tok


def make_checkpoint(
    path: Path,
    *,
    tie: bool = False,
    norm_topk_prob: bool = True,
    mlp_only_layers=(),
    decoder_sparse_step: int = 1,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    num_experts: int = 8,
    top_k: int = 2,
    seed: int = 0,
) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    eos = tokenizer.token_to_id("<|endoftext|>")
    config = Qwen3MoeConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=list(mlp_only_layers),
        decoder_sparse_step=decoder_sparse_step,
        tie_word_embeddings=tie,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=eos,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        # Default init leaves norms at 1 and the router at 0; randomise so every path is exercised.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "mlp.gate.weight" in name:
                param.normal_(0, 0.5)
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def load_reference(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model


# The lean CPU paths' logits against the general path's, relative to the largest logit, by weight
# form (engine.model.lean_matrices): fp32 differs in rounding alone, on every step or row; int8
# rounds weights to 1/254 of a row's largest and activations to bf16, on the median step or row
# (now and then a random model's near-tied router picks another expert from the rounded input).
LEAN_PATH_TOLERANCE = {"fp32": 1e-5, "int8": 2e-2}


def lean_path_model(variant: str, form: str = "fp32"):
    """A random fp32 model for the lean CPU paths' tests, its lean path's weights in `form`:
    "moe" (every layer MoE, tied embeddings), "dense_and_untied" (layer 0 dense, an own lm_head)
    or "bias" (q/k/v and o biases)."""
    from engine.loading.random_model import TINY, random_model
    from engine.model.options import ModelOptions

    config = dict(TINY, vocab_size=512)
    if variant == "dense_and_untied":
        config.update(mlp_only_layers=[0], tie_word_embeddings=False)
    options = ModelOptions(lean_weights=form)
    model = random_model(config, dtype=torch.float32, seed=3, options=options)
    if variant == "bias":
        g = torch.Generator().manual_seed(4)
        for layer in model.layers:
            layer.b_qkv = 0.1 * torch.randn(layer.w_qkv.shape[0], generator=g)
            layer.b_o = 0.1 * torch.randn(layer.w_o.shape[0], generator=g)
    return model


def scaled_training_model(config: dict, seed: int = 0, moe: str = "sparse"):
    """engine/train/model.py's Qwen3MoeLM, its weights 4x init: large enough that routing and
    experts matter when two forwards are compared."""
    from engine.train.model import Qwen3MoeLM

    model = Qwen3MoeLM(config, moe=moe)
    model.init_weights(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    return model


def engine_logits(model_dir, ids: torch.Tensor) -> torch.Tensor:
    """The engine's logits [B, T, V] of token rows ids [B, T], loaded from model_dir."""
    from engine.loading.loader import load_model

    engine = load_model(model_dir)
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    return engine.forward(ids, positions, engine.new_cache(ids.shape[0]))


def max_rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude of the reference."""
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def row_scaled_weights(shape, seed: int = 0) -> torch.Tensor:
    """Fresh random weights whose magnitude varies by row, so quantization blocks or groups get
    different scales."""
    g = torch.Generator().manual_seed(seed)
    return 0.02 * torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g))


def quantizable_training_config() -> dict:
    """A tiny engine/train config whose projections are 64x64 (q, o), 32x64 (k, v), 32x64 and 64x32
    (experts): every dim a multiple of 32, as quantized exports need."""
    from engine.train.config import CONFIG

    return {
        **CONFIG,
        "vocab_size": 96,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    }


def quantized_folder(src, dst, fmt: str, size: int):
    """A copy of a checkpoint with every projection stored quantized (fp8: blocks of size x size;
    int4: groups of size), as releases ship them."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.loading import fp8, int4

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if t.ndim == 2 and name.endswith("_proj.weight"):
            if fmt == "fp8":
                out[name], out[name + fp8.SCALE_SUFFIX] = fp8.quantize(t, size)
            else:
                out.update(int4.store(name, t, size))
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [size] * 2}
        if fmt == "fp8"
        else int4.quantization_config(size, ["lm_head"])
    )
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
