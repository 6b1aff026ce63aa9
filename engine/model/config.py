"""Model configuration read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
QUANT_METHODS = (
    "fp8",
    "compressed-tensors",
)  # the schemes engine.loading.checkpoint_reader dequantizes at load


class ModelFormatError(ValueError):
    """A model folder the engine cannot load; the message names what is wrong."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    def is_moe_layer(self, layer: int) -> bool:
        """Same rule as transformers' Qwen3-MoE decoder layer."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or [cfg.get("model_type", "unknown")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelFormatError(
                f"unsupported architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise ModelFormatError(f"config.json lacks {key!r}")
        heads = cfg["num_attention_heads"]
        quant = cfg.get("quantization_config")
        if quant is not None and not isinstance(quant, dict):
            raise ModelFormatError(
                f"quantization_config must be an object, got {type(quant).__name__}"
            )
        if quant and quant.get("quant_method") not in QUANT_METHODS:
            # Block-scaled FP8 and group-scaled int4 weights are dequantized at load; other schemes
            # would need their own kernels.
            raise ModelFormatError(
                f"unsupported quantization {quant.get('quant_method')!r}; block-scaled fp8 and "
                "int4 (compressed-tensors pack-quantized) checkpoints load"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelFormatError(
                f"unsupported hidden_act {cfg['hidden_act']!r}; only silu is implemented"
            )
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window") else None,
            intermediate_size=cfg.get("intermediate_size", 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            # transformers 5 may save the expert count under its alias num_local_experts.
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts", 0)),
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            eos_token_ids=_as_ids(cfg.get("eos_token_id")),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            raw=cfg,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelFormatError(f"no config.json in {model_dir}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelFormatError(f"config.json is not valid JSON: {exc}") from exc
        return cls.from_dict(cfg)


def _rope_theta(cfg: dict) -> float:
    """rope_theta lives at the top level (transformers 4) or in rope_parameters (transformers 5)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type != "default":
        raise ModelFormatError(
            f"unsupported RoPE type {rope_type!r}; only default RoPE is implemented"
        )
    return float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
