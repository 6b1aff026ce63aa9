"""Reading tensors from a Hugging Face safetensors checkpoint (single file or shards)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelFormatError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointReader:
    """Name -> tensor over all shards; errors name the missing or mis-shaped tensor."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            for name, shard in weight_map.items():
                self._file_of[name] = self.model_dir / shard
        else:
            files = sorted(self.model_dir.glob("*.safetensors"))
            if not files:
                raise ModelFormatError(f"no *.safetensors weights in {self.model_dir}")
            for path in files:
                for name in self._open(path).keys():
                    self._file_of[name] = path

    def _open(self, path: Path):
        if path not in self._handles:
            if not path.is_file():
                raise ModelFormatError(f"weight shard {path.name} is listed in {INDEX_FILE} but missing")
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def names(self) -> list[str]:
        return list(self._file_of)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if name not in self._file_of:
            raise ModelFormatError(f"missing tensor {name!r} in {self.model_dir}")
        tensor = self._open(self._file_of[name]).get_tensor(name)
        if tuple(tensor.shape) != tuple(shape):
            raise ModelFormatError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}"
            )
        return tensor.to(dtype)
