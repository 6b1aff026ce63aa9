"""Load a Hugging Face Qwen3-MoE folder into the engine's layout, once, at load time.

Per-expert tensors on disk (`mlp.experts.N.{gate,up,down}_proj.weight`) become the fused
layout the kernels read: gate_up [E, 2I, H] (gate rows first) and down [E, H, I]. Folders
saved with the fused in-memory names (`mlp.experts.gate_up_proj`) load too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.loading import int4
from engine.loading.checkpoint_reader import CheckpointReader
from engine.loading.fp8 import block_size
from engine.model.config import ModelConfig, ModelFormatError
from engine.model.layer import LayerWeights
from engine.model.options import ModelOptions
from engine.model.qwen3_moe import Qwen3MoeModel
from kernels import quant
from kernels.quant import Weight, dequantize, is_quantized, kernels_read

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Default: fp32 on the CPU (fast and exact there), the checkpoint's half type on a GPU."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    experts: range | None = None,
    options: ModelOptions | None = None,
    keep_quantized: bool | None = None,
) -> Qwen3MoeModel:
    """`experts`: load only these experts of each MoE layer (expert parallelism,
    `engine.model.expert_parallel`). `options`: how the model computes (engine.model.options).
    `keep_quantized`: FP8 and int4 weights stay as stored (kernels.quant) for the kernels to
    read; by default on CUDA only (elsewhere they are dequantized once, here)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelFormatError(f"model folder {model_dir} does not exist")
    config = ModelConfig.from_dir(model_dir)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    reader = CheckpointReader(model_dir, fp8_block(config), int4_group(config))
    if keep_quantized is None:
        keep_quantized = device.type == "cuda"

    def get(name: str, *shape: int) -> torch.Tensor:
        return reader.get(name, shape, dtype).to(device)

    def weight(name: str, *shape: int) -> Weight:
        stored = reader.get_stored(name, shape, dtype)
        if is_quantized(stored) and keep_quantized:
            return quant.to(stored, device)
        return dequantize(stored, dtype).to(device)

    def joined(parts: list[Weight]) -> Weight:
        """Row blocks of one product (q, k, v; gate, up) as one weight, quantized where the
        format lets them join and the kernels read the result, else in `dtype`."""
        fused = quant.cat_rows(parts)
        if fused is None or not kernels_read(fused):
            fused = torch.cat([dequantize(part, dtype) for part in parts])
        return fused

    h, d = config.hidden_size, config.head_dim
    hq, hkv = config.num_heads * d, config.num_kv_heads * d
    embed = get("model.embed_tokens.weight", config.vocab_size, h)
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        w_qkv = joined(
            [
                weight(attn + "q_proj.weight", hq, h),
                weight(attn + "k_proj.weight", hkv, h),
                weight(attn + "v_proj.weight", hkv, h),
            ]
        )
        b_qkv = b_o = None
        if config.attention_bias:
            b_qkv = torch.cat(
                [
                    get(attn + "q_proj.bias", hq),
                    get(attn + "k_proj.bias", hkv),
                    get(attn + "v_proj.bias", hkv),
                ]
            )
            b_o = get(attn + "o_proj.bias", h) if attn + "o_proj.bias" in reader else None
        if config.is_moe_layer(i):
            w_gate_up, w_down = _load_experts(
                get, weight, joined, reader, p + "mlp.", config, dtype, experts
            )
            router = get(p + "mlp.gate.weight", config.num_experts, h)
        else:
            inter = config.intermediate_size
            w_gate_up = joined(
                [
                    weight(p + "mlp.gate_proj.weight", inter, h),
                    weight(p + "mlp.up_proj.weight", inter, h),
                ]
            )
            w_down = readable(weight(p + "mlp.down_proj.weight", h, inter), dtype)
            router = None
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight", h),
                post_attention_norm=get(p + "post_attention_layernorm.weight", h),
                w_qkv=w_qkv,
                b_qkv=b_qkv,
                q_norm=get(attn + "q_norm.weight", d),
                k_norm=get(attn + "k_norm.weight", d),
                w_o=readable(weight(attn + "o_proj.weight", h, hq), dtype),
                b_o=b_o,
                w_gate_up=w_gate_up,
                w_down=w_down,
                router=router,
            )
        )
    final_norm = get("model.norm.weight", h)
    # Tied: the output projection is the embedding matrix itself (HF ignores any saved lm_head).
    lm_head = (
        embed
        if config.tie_word_embeddings
        else readable(weight("lm_head.weight", config.vocab_size, h), dtype)
    )
    return Qwen3MoeModel(config, embed, layers, final_norm, lm_head, options)


def fp8_block(config: ModelConfig) -> tuple[int, int] | None:
    try:
        return block_size(config.raw)
    except ValueError as exc:
        raise ModelFormatError(str(exc)) from exc


def int4_group(config: ModelConfig) -> int | None:
    try:
        return int4.config_group_size(config.raw)
    except ValueError as exc:
        raise ModelFormatError(str(exc)) from exc


def readable(w: Weight, dtype: torch.dtype) -> Weight:
    """The weight as stored where the kernels read it so, else dequantized to `dtype`."""
    return w if kernels_read(w) else dequantize(w, dtype)


def _load_experts(
    get,
    weight,
    joined,
    reader: CheckpointReader,
    prefix: str,
    config: ModelConfig,
    dtype: torch.dtype,
    experts: range | None = None,
):
    e, h, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
    experts = range(e) if experts is None else experts
    if prefix + "experts.gate_up_proj" in reader:
        gate_up, down = (
            get(prefix + "experts.gate_up_proj", e, 2 * inter, h),
            get(prefix + "experts.down_proj", e, h, inter),
        )
        if len(experts) == e:
            return gate_up, down
        # Fused on disk: read whole, keep the slice (cloned, so the rest is freed).
        return gate_up[experts.start : experts.stop].clone(), down[
            experts.start : experts.stop
        ].clone()
    gate_up, down = [], []
    for n in experts:
        ex = f"{prefix}experts.{n}."
        gate_up.append(
            joined(
                [weight(ex + "gate_proj.weight", inter, h), weight(ex + "up_proj.weight", inter, h)]
            )
        )
        down.append(weight(ex + "down_proj.weight", h, inter))
    return _stacked(gate_up, dtype), readable(_stacked(down, dtype), dtype)


def _stacked(weights: list[Weight], dtype: torch.dtype) -> Weight:
    """Experts' weights as one [E, N, K] weight: quantized if all are, in one format."""
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.stack(weights)
    try:
        return quant.stack(weights)
    except ValueError:  # some joined only after dequantizing: all go that way
        return torch.stack([dequantize(w, dtype) for w in weights])
