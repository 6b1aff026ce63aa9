"""Reading tensors from a Hugging Face safetensors checkpoint (single file or shards)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.loading.fp8 import FP8, SCALE_SUFFIX
from engine.model.config import ModelFormatError
from kernels.quant import Fp8Weight, Int4Weight, QuantWeight, dequantize

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointReader:
    """Name -> tensor over all shards; errors name the missing or mis-shaped tensor.

    A weight stored as block-scaled FP8 (`X.weight` in float8_e4m3fn next to its
    `X.weight_scale_inv`, as in Qwen's FP8 releases) comes back dequantized to the asked dtype, and
    so does one stored as group-scaled int4 (`X.weight_packed`, `X.weight_scale`, `X.weight_shape`,
    engine/loading/int4.py). `get_stored` gives such weights as stored instead (kernels.quant)."""

    def __init__(
        self,
        model_dir: str | Path,
        fp8_block: tuple[int, int] | None = None,
        int4_group: int | None = None,
    ):
        self.model_dir = Path(model_dir)
        self.fp8_block = fp8_block  # the config's weight_block_size, for fp8 checkpoints
        self.int4_group = int4_group  # the config's group_size, for int4 checkpoints
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
                raise ModelFormatError(
                    f"weight shard {path.name} is listed in {INDEX_FILE} but missing"
                )
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def __contains__(self, name: str) -> bool:
        return name in self._file_of or name + "_packed" in self._file_of

    def _tensor(self, name: str) -> torch.Tensor:
        return self._open(self._file_of[name]).get_tensor(name)

    def names(self) -> list[str]:
        return list(self._file_of)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.get_stored(name, shape, dtype), dtype)

    def get_stored(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor | QuantWeight:
        """The weight as the checkpoint stores it: an FP8 or int4 weight (kernels.quant, with
        the checkpoint's scales) where it is quantized, else the tensor in `dtype`."""
        if name + "_packed" in self._file_of:
            return self._get_int4(name, shape)
        if name not in self._file_of:
            raise ModelFormatError(f"missing tensor {name!r} in {self.model_dir}")
        tensor = self._tensor(name)
        if tuple(tensor.shape) != tuple(shape):
            raise ModelFormatError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}"
            )
        scale_name = name + SCALE_SUFFIX
        if scale_name in self._file_of:
            if tensor.dtype != FP8 or tensor.ndim != 2:
                raise ModelFormatError(
                    f"tensor {name!r} has a {scale_name!r} but is {tensor.dtype}, "
                    "not a 2-D fp8 matrix"
                )
            if self.fp8_block is None:
                raise ModelFormatError(
                    f"tensor {name!r} is fp8 but config.json has no fp8 quantization_config"
                )
            scale = self._open(self._file_of[scale_name]).get_tensor(scale_name)
            try:
                weight = Fp8Weight(tensor, scale.float(), self.fp8_block)
            except ValueError as exc:
                raise ModelFormatError(f"tensor {name!r}: {exc}") from exc
            if not (torch.isfinite(weight.scale).all() and (weight.scale > 0).all()):
                raise ModelFormatError(f"tensor {name!r}: fp8 scales must be finite and positive")
            return weight
        if tensor.dtype == FP8:
            raise ModelFormatError(f"fp8 tensor {name!r} has no {scale_name!r}")
        return tensor.to(dtype)

    def _get_int4(self, name: str, shape: tuple[int, ...]) -> Int4Weight:
        if self.int4_group is None:
            raise ModelFormatError(
                f"tensor {name!r} is int4 but config.json has no compressed-tensors "
                "quantization_config"
            )
        if name + "_g_idx" in self._file_of:  # activation order: groups permuted over the columns
            raise ModelFormatError(
                f"int4 tensor {name!r} has a group index (activation order), "
                "which this engine does not read"
            )
        for part in ("_scale", "_shape"):
            if name + part not in self._file_of:
                raise ModelFormatError(f"int4 tensor {name!r} has no {name + part!r}")
        if name in self._file_of:
            raise ModelFormatError(f"tensor {name!r} is stored both plain and as int4")
        stored = self._tensor(name + "_shape")
        if stored.shape != (2,) or stored.is_floating_point():
            raise ModelFormatError(
                f"tensor {name!r}: {name + '_shape'!r} must hold two integers, "
                f"got {stored.tolist()!r}"
            )
        stored_shape = tuple(int(n) for n in stored.tolist())
        if stored_shape != tuple(shape):
            raise ModelFormatError(
                f"tensor {name!r} has shape {stored_shape}, expected {tuple(shape)}"
            )
        scale = self._tensor(name + "_scale")
        if scale.ndim != 2 or scale.shape[1] * self.int4_group != shape[1]:
            raise ModelFormatError(
                f"tensor {name!r}: int4 scales {tuple(scale.shape)} do not give groups of "
                f"{self.int4_group} over {tuple(shape)}"
            )
        if not scale.is_floating_point():
            raise ModelFormatError(f"tensor {name!r}: int4 scales must be floating point")
        if not (torch.isfinite(scale.float()).all() and (scale.float() > 0).all()):
            raise ModelFormatError(f"tensor {name!r}: int4 scales must be finite and positive")
        packed = self._tensor(name + "_packed")
        out_f, in_f = shape
        if packed.dtype != torch.int32 or tuple(packed.shape) != (out_f, in_f // 8) or in_f % 8:
            raise ModelFormatError(
                f"int4 tensor {name!r} {tuple(shape)} needs packed int32 [{out_f}, {in_f // 8}], "
                f"got {packed.dtype} {tuple(packed.shape)}"
            )
        try:
            return Int4Weight(packed, scale, self.int4_group)
        except ValueError as exc:
            raise ModelFormatError(f"tensor {name!r}: {exc}") from exc
