"""Turn a training checkpoint into the shipped Hugging Face model folder.

    python -m engine.train.export --ckpt RUN_OUT/ckpt --model-dir MODEL_DIR \\
        [--fp8-block 64 | --int4-group 32]

Writes one `model.safetensors` (standard per-expert HF keys, tied lm_head omitted as transformers
does; bf16, or with --fp8-block the attention and expert projections as block-scaled FP8 in the
format of Qwen's FP8 releases, which the engine and transformers both read, or with --int4-group as
group-scaled int4 in compressed-tensors' pack-quantized format, engine/loading/int4.py),
`config.json`, `generation_config.json`, and copies the run's `log.jsonl`, `state.json` and
`loss.png` next to it as `training_log.jsonl` / `training_state.json` / `loss.png`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from engine.loading import int4
from engine.loading.quantize import (
    fp8_quantization_config,
    fp8_weights,
    int4_ignore,
    int4_weights,
)

from . import checkpoint
from .config import CONFIG, write_configs
from .grow import expert_count, expert_width


def quant_flags_error(fp8_block: int | None, int4_group: int | None) -> str | None:
    """What is wrong with --fp8-block / --int4-group given together (train and export take both)."""
    if fp8_block and int4_group:
        return "--fp8-block and --int4-group are two formats: give one"
    if int4_group is not None and (int4_group <= 0 or int4_group % 8):
        return "--int4-group must be a positive multiple of 8"
    return None


def trained_context(state: dict) -> int:
    """The longest row any run of this model trained on: positions beyond it were never seen, so
    the engine must not prompt past it (runs that predate `seq_len` in their record used 1,024)."""
    return max(
        (run.get("seq_len", 1024) for run in state.get("runs", [])),
        default=CONFIG["max_position_embeddings"],
    )


def trained_shape(ckpt: Path) -> dict:
    """The config.json a checkpoint (or an exported folder) holds, without its quantization,
    else CONFIG."""
    path = Path(ckpt) / "config.json"
    if not path.exists():
        return dict(CONFIG)
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    return config


def export(
    ckpt: Path, model_dir: Path, fp8_block: int | None = None, int4_group: int | None = None
) -> Path:
    weights = {k: v.contiguous() for k, v in sorted(checkpoint.load_weights(ckpt).items())}
    # The shape the checkpoint records (a model trained from scratch at another size), else
    # CONFIG's (checkpoints from before it was recorded); grown runs' experts from the weights.
    config = {
        **trained_shape(ckpt),
        "moe_intermediate_size": expert_width(weights),
        "num_experts": expert_count(weights),
        "max_position_embeddings": trained_context(checkpoint.load_state(ckpt)),
    }
    if fp8_block:
        weights = fp8_weights(weights, fp8_block)
        config["quantization_config"] = fp8_quantization_config(config, fp8_block)
    elif int4_group:
        weights = int4_weights(weights, int4_group)
        config["quantization_config"] = int4.quantization_config(int4_group, int4_ignore(config))
    write_configs(model_dir, config)
    path = model_dir / "model.safetensors"
    save_file(weights, str(path), metadata={"format": "pt"})
    run_dir = Path(ckpt).parent
    for src, dst in (("log.jsonl", "training_log.jsonl"), ("loss.png", "loss.png")):
        if (run_dir / src).exists():
            shutil.copyfile(run_dir / src, model_dir / dst)
    shutil.copyfile(Path(ckpt) / "state.json", model_dir / "training_state.json")
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument(
        "--fp8-block",
        type=int,
        help="ship the projections as FP8 with this block size (as trained with train "
        "--fp8-block); it must divide the hidden and expert sizes for transformers to load it. "
        "Without it, a checkpoint trained with --fp8-block ships its unrounded bf16 weights",
    )
    ap.add_argument(
        "--int4-group",
        type=int,
        help="ship the projections as int4 with one scale per this many input columns (as "
        "trained with train --int4-group; a multiple of 8 that divides the hidden and expert "
        "sizes)",
    )
    args = ap.parse_args(argv)
    if args.fp8_block is not None and args.fp8_block <= 0:
        ap.error("--fp8-block must be a positive number of rows and columns")
    if error := quant_flags_error(args.fp8_block, args.int4_group):
        ap.error(error)
    path = export(args.ckpt, args.model_dir, args.fp8_block, args.int4_group)
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
