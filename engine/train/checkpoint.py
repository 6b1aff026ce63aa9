"""Checkpoints small enough to come back from the GPU machine: bf16 weights in shards of at most
~16 MB (safetensors, HF parameter names), plus `state.json` (step, tokens seen, run history) and
the model's `config.json` (its shape, which need not be the shipped model's).

Adam moments are not saved (fp32 moments would be ~180 MB): a resumed run restarts the optimizer
with a short warm-up, which costs a few dozen steps, not quality.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.loading import int4
from engine.loading.fp8 import SCALE_SUFFIX, block_size, dequantize

SHARD_BYTES = 16_000_000


def save(model: torch.nn.Module, state: dict, out: Path, config: dict | None = None) -> None:
    """Written whole into a side folder, then renamed over `out`, so a copy taken while a run
    is saving never pairs shards or state of two different steps. `config`: the model's
    config.json, kept beside the weights so an export writes the shape that was trained."""
    final, out = Path(out), Path(str(out) + ".tmp")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shards, cur, size = [], {}, 0
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu", torch.bfloat16).contiguous()
        if size + t.numel() * 2 > SHARD_BYTES and cur:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += t.numel() * 2
    shards.append(cur)
    for i, shard in enumerate(shards):
        save_file(
            shard,
            str(out / f"model-{i:02d}-of-{len(shards):02d}.safetensors"),
            metadata={"format": "pt"},
        )
    (out / "state.json").write_text(json.dumps(state, indent=1) + "\n")
    if config is not None:
        plain = {k: v for k, v in config.items() if k != "quantization_config"}
        (out / "config.json").write_text(json.dumps(plain, indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    out.rename(final)


# A run resumes from a checkpoint folder or from an exported model folder (the shipped model).
EXPORTED_WEIGHTS, EXPORTED_STATE, EXPORTED_LOG = (
    "model.safetensors",
    "training_state.json",
    "training_log.jsonl",
)


def load_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """HF-named weights; an FP8 or int4 export comes back dequantized (exactly, in bf16)."""
    shards = sorted(Path(ckpt).glob("model-*.safetensors")) or [Path(ckpt) / EXPORTED_WEIGHTS]
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(str(shard)))
    scales = [k for k in weights if k.endswith(SCALE_SUFFIX)]
    if scales:
        config = Path(ckpt) / "config.json"
        block = block_size(json.loads(config.read_text())) if config.exists() else None
        if block is None:
            raise ValueError(
                f"{ckpt} holds fp8 scales but its config.json names no fp8 quantization_config"
            )
        for key in scales:
            name = key.removesuffix(SCALE_SUFFIX)
            weights[name] = dequantize(weights[name], weights.pop(key), block, torch.bfloat16)
    for key in [k for k in weights if k.endswith(".weight_packed")]:
        name = key.removesuffix("_packed")
        shape = weights.pop(name + "_shape").tolist()
        weights[name] = int4.dequantize(
            weights.pop(key), weights.pop(name + "_scale"), shape, torch.bfloat16
        )
    return weights


def load_state(ckpt: Path) -> dict:
    path = Path(ckpt) / "state.json"
    return json.loads((path if path.exists() else Path(ckpt) / EXPORTED_STATE).read_text())


def previous_log(ckpt: Path) -> Path | None:
    """The training log that goes with a checkpoint (a run's OUT/log.jsonl, or an exported one)."""
    for path in (Path(ckpt) / EXPORTED_LOG, Path(ckpt).parent / "log.jsonl"):
        if path.exists():
            return path
    return None
