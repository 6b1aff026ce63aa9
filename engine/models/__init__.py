"""Models shipped inside the package: the default one runs with no download."""

from __future__ import annotations

import os
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent
# The embedded default model's folder name under engine/models/.
DEFAULT_MODEL_NAME = "wd-coder-tiny"
MODEL_ENV_VAR = "WD_LSP_MODEL"


def default_model_dir() -> Path:
    """`WD_LSP_MODEL` if set, else the embedded default model."""
    override = os.environ.get(MODEL_ENV_VAR)
    return Path(override) if override else MODELS_DIR / DEFAULT_MODEL_NAME
