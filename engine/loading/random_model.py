"""A model with random weights of any Qwen3-MoE shape, built straight in the engine's layout.

For benchmarks of shapes whose weights can't be downloaded (e.g. Qwen3-30B-A3B on a GPU with no
network). Weights are scaled like a trained model's (unit-variance activations), never zeros.
With `quant`, the projections are quantized by the project's own quantizers (FP8 blocks or int4
groups, engine.loading.fp8 / int4) and kept as stored, as a quantized checkpoint loads on CUDA.
"""

from __future__ import annotations

import math

import torch

from engine.loading import fp8, int4
from engine.model.config import ModelConfig
from engine.model.layer import LayerWeights
from engine.model.options import ModelOptions
from engine.model.qwen3_moe import Qwen3MoeModel

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"],
    vocab_size=151936,
    hidden_size=2048,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=10000000.0,
    max_position_embeddings=262144,
    tie_word_embeddings=False,
)

# A few-MB model for checks on the CPU: the embedded tokenizer's vocabulary, 2 MoE layers.
TINY = dict(
    architectures=["Qwen3MoeForCausalLM"],
    vocab_size=16000,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)

QWEN3_235B_A22B = dict(
    QWEN3_30B_A3B,
    hidden_size=4096,
    num_hidden_layers=94,
    num_attention_heads=64,
    intermediate_size=12288,
    moe_intermediate_size=1536,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
)

SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "qwen3-235b-a22b": QWEN3_235B_A22B, "tiny": TINY}


def shape_config(name: str, vocab_size: int | None = None) -> dict:
    """A named shape's config (`SHAPES`), optionally with another vocabulary size."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return dict(SHAPES[name], **({"vocab_size": vocab_size} if vocab_size else {}))


def random_model(
    config: dict,
    dtype=torch.bfloat16,
    device="cpu",
    seed: int = 0,
    options: ModelOptions | None = None,
    quant: str | None = None,
    quant_size: int = 128,
    quant_lm_head: bool = False,
) -> Qwen3MoeModel:
    """`quant`: None, "fp8" (blocks of quant_size x quant_size) or "int4" (groups of
    quant_size input columns) for the attention and MLP projections, and with `quant_lm_head`
    for the model's own lm_head (a tied one stays the embedding)."""
    cfg = ModelConfig.from_dict(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    if quant not in (None, "fp8", "int4"):
        raise ValueError(f"unknown quantization {quant!r}; expected fp8 or int4")
    if quant_lm_head and (quant is None or cfg.tie_word_embeddings):
        raise ValueError("a quantized lm_head needs --quant and a shape with its own lm_head")

    def w(*shape, fan_in):
        return (
            torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
            / math.sqrt(fan_in)
        ).to(dtype)

    def proj(*shape, fan_in):
        if quant is None:
            return w(*shape, fan_in=fan_in)
        drawn = torch.randn(*shape, generator=gen, device=device) / math.sqrt(fan_in)
        if quant == "fp8":
            return fp8.quantized_weight(drawn, quant_size)
        return int4.quantized_weight(drawn, quant_size)

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=gen, device=device)).to(dtype)

    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    layers = []
    for i in range(cfg.num_layers):
        if cfg.is_moe_layer(i):
            e, inter = cfg.num_experts, cfg.moe_intermediate_size
            w_gate_up, w_down, router = (
                proj(e, 2 * inter, h, fan_in=h),
                proj(e, h, inter, fan_in=inter),
                w(e, h, fan_in=h),
            )
        else:
            inter = cfg.intermediate_size
            w_gate_up = proj(2 * inter, h, fan_in=h)
            w_down, router = proj(h, inter, fan_in=inter), None
        layers.append(
            LayerWeights(
                input_norm=norm(h),
                post_attention_norm=norm(h),
                w_qkv=proj(q + 2 * kv, h, fan_in=h),
                b_qkv=None,
                q_norm=norm(d),
                k_norm=norm(d),
                w_o=proj(h, q, fan_in=q),
                b_o=None,
                w_gate_up=w_gate_up,
                w_down=w_down,
                router=router,
            )
        )
    embed = w(cfg.vocab_size, h, fan_in=1)
    if cfg.tie_word_embeddings:
        lm_head = embed
    elif quant_lm_head:
        lm_head = proj(cfg.vocab_size, h, fan_in=h)
    else:
        lm_head = w(cfg.vocab_size, h, fan_in=h)
    return Qwen3MoeModel(cfg, embed, layers, norm(h), lm_head, options)
