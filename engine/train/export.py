"""Turn a training checkpoint into the shipped Hugging Face model folder.

    python -m engine.train.export --ckpt RUN_OUT/ckpt --model-dir engine/models/wd-coder-tiny

Writes one `model.safetensors` (bf16, standard per-expert HF keys, tied lm_head omitted as
transformers does), `config.json`, `generation_config.json`, and copies the run's `log.jsonl`,
`state.json` and `loss.png` next to it as `training_log.jsonl` / `training_state.json` / `loss.png`.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from safetensors.torch import save_file

from . import checkpoint
from .config import CONFIG, write_configs


def export(ckpt: Path, model_dir: Path) -> Path:
    weights = {k: v.contiguous() for k, v in sorted(checkpoint.load_weights(ckpt).items())}
    write_configs(model_dir, CONFIG)
    path = model_dir / "model.safetensors"
    save_file(weights, str(path), metadata={"format": "pt"})
    run_dir = Path(ckpt).parent
    for src, dst in (("log.jsonl", "training_log.jsonl"), ("loss.png", "loss.png")):
        if (run_dir / src).exists():
            shutil.copyfile(run_dir / src, model_dir / dst)
    shutil.copyfile(Path(ckpt) / "state.json", model_dir / "training_state.json")
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--model-dir", type=Path, required=True)
    args = ap.parse_args(argv)
    path = export(args.ckpt, args.model_dir)
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
