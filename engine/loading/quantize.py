"""Quantizing weights into the checkpoint formats the engine reads: block-scaled FP8 (Qwen's FP8
releases, engine/loading/fp8.py) and group-scaled int4 (compressed-tensors pack-quantized W4A16,
engine/loading/int4.py).

Two entry points: the state-dict helpers (`fp8_weights`, `int4_weights` and the configs that go with
them), which training's export uses, and `quantize_folder`, behind `wd-engine quantize`, which turns
a bf16/fp16/fp32 Hugging Face Qwen3-MoE folder into a quantized one that this engine and
transformers read (in the formats vLLM reads too). The folder is streamed one tensor at a time (a
30B model does not fit in memory twice), written into a temporary sibling folder and renamed into
place only when complete, so that neither a failure nor a second run ever leaves a half-written or
overwritten DST.

What is quantized: the attention q/k/v/o projections and the gate/up/down projections of the
experts and of any dense MLP (every 2-D `*_proj.weight`), and on request (`lm_head=True`) a model's
own lm_head. The embedding, routers and norms stay as stored: they are small, and the router's
choices are brittle. The lm_head stays by default, as in Qwen's FP8 releases: it moves every logit,
but in a decode step of a 30B-A3B it is a sixth to a quarter of the bytes a quantized step reads.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.loading import int4
from engine.loading.checkpoint_reader import INDEX_FILE, SINGLE_FILE
from engine.loading.fp8 import SCALE_SUFFIX, quantize
from engine.loading.memory import SAFETENSORS_ITEMSIZE
from engine.model.config import ModelConfig, ModelFormatError

FORMATS = ("fp8", "int4")
DEFAULT_BLOCK = 128  # Qwen's FP8 releases
DEFAULT_GROUP = 128  # llm-compressor's W4A16 preset
DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size
SOURCE_DTYPES = {"BF16": 2, "F16": 2, "F32": 4}  # safetensors' names, bytes per element
_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int32: "I32",
}
ROUTER_SUFFIX = ".mlp.gate.weight"
LM_HEAD = "lm_head.weight"
# Weight files of a folder, replaced (safetensors) or not carried over (the other formats).
WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|gguf)$|.*\.safetensors\.index\.json$")


def _is_projection(name: str, t) -> bool:
    """q/k/v/o and the experts' gate/up/down: what the quantized formats store quantized."""
    return _projection_shape(name, t.shape)


def _projection_shape(name: str, shape) -> bool:
    return len(shape) == 2 and name.endswith("_proj.weight")


def router_names(config: dict) -> list[str]:
    """The routers, Linear modules both formats leave unquantized (their choices are brittle)."""
    return [f"model.layers.{i}.mlp.gate" for i in range(config["num_hidden_layers"])]


def fp8_weights(weights: dict, block: int) -> dict:
    """The projections (q/k/v/o, experts' gate/up/down) as FP8 + scales; embedding, router and
    norms stay as they are."""
    out = {}
    for name, t in weights.items():
        if _is_projection(name, t):
            out[name], out[name + SCALE_SUFFIX] = quantize(t, block)
        else:
            out[name] = t
    return out


def int4_weights(weights: dict, group: int) -> dict:
    """The projections as int4 (engine/loading/int4.py); embedding, router and norms stay."""
    out = {}
    for name, t in weights.items():
        out.update(int4.store(name, t, group) if _is_projection(name, t) else {name: t})
    return out


def int4_ignore(
    config: dict, routers: list[str] | None = None, lm_head_quantized: bool = False
) -> list[str]:
    """The Linear modules left unquantized: the head (unless quantized) and the routers
    (`routers`: their module names, default one per layer)."""
    head = [] if lm_head_quantized else ["lm_head"]
    return head + (router_names(config) if routers is None else routers)


def fp8_quantization_config(
    config: dict, block: int, routers: list[str] | None = None, lm_head_quantized: bool = False
) -> dict:
    """config.json's `quantization_config` for weights stored by `fp8_weights`, as Qwen's FP8
    releases spell it."""
    # Modules left unquantized are named, as Qwen's FP8 configs do, so a loader that would swap in
    # FP8 layers (transformers on a GPU, vLLM) leaves them alone.
    keep = ([] if lm_head_quantized else ["lm_head"]) + ["model.embed_tokens"]
    keep += router_names(config) if routers is None else routers
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
        "modules_to_not_convert": keep,
    }


# --- whole folders ----------------------------------------------------------------------------


class QuantizeError(ValueError):
    """A folder `quantize_folder` refuses; the message says why."""


@dataclass(frozen=True)
class QuantizeSummary:
    dst: Path
    quantized: int  # source tensors written quantized
    tensors: int  # source tensors in all
    bytes_before: int  # the source tensors' bytes
    bytes_after: int  # the written tensors' bytes
    shards: int

    def line(self, fmt: str) -> str:
        return (
            f"{self.dst}: {self.quantized} of {self.tensors} tensors quantized to {fmt}, "
            f"{_size(self.bytes_before)} -> {_size(self.bytes_after)} "
            f"in {self.shards} shard{'s' if self.shards > 1 else ''}"
        )


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


@dataclass(frozen=True)
class _Source:
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: BF16, F16, F32
    quantized: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * SOURCE_DTYPES[self.dtype]


def _natural_key(name: str):
    """model.layers.2 before model.layers.10: shards then hold whole layers in order."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _weight_files(src: Path) -> list[Path]:
    index = src / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise QuantizeError(f"{index} is not a safetensors index: {exc}") from exc
        files = [src / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise QuantizeError(f"weight shard {f.name} is listed in {INDEX_FILE} but missing")
        return files
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise QuantizeError(f"no *.safetensors weights in {src}")
    return files


def _sources(src: Path, lm_head: bool = False) -> list[_Source]:
    """Every tensor's name, file, shape and dtype, read from the files' headers only; `lm_head`:
    the lm_head is quantized with the projections."""
    found: dict[str, _Source] = {}
    for path in _weight_files(src):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                shape, dtype = tuple(part.get_shape()), part.get_dtype()
                if name.endswith((SCALE_SUFFIX, "_packed", "_scale", "_shape", "_zero_point")):
                    raise QuantizeError(
                        f"{src} is already quantized: it holds {name!r}; give a bf16, fp16 or fp32 "
                        "folder"
                    )
                if dtype not in SOURCE_DTYPES:
                    raise QuantizeError(
                        f"tensor {name!r} in {path.name} is {dtype}: quantize reads bf16, fp16 or "
                        "fp32 folders"
                        + (" (this one is already quantized)" if dtype.startswith("F8") else "")
                    )
                if name in found:
                    raise QuantizeError(f"tensor {name!r} is stored twice ({path.name})")
                if len(shape) == 3 and name.endswith("_proj"):
                    raise QuantizeError(
                        f"tensor {name!r} holds all experts in one tensor; quantize reads the "
                        "Hugging Face layout, one tensor per expert (mlp.experts.N.*_proj.weight)"
                    )
                quantized = _projection_shape(name, shape) or (
                    lm_head and name == LM_HEAD and len(shape) == 2
                )
                found[name] = _Source(name, path, shape, dtype, quantized)
    files = {path: n for n, path in enumerate(dict.fromkeys(s.file for s in found.values()))}
    return sorted(found.values(), key=lambda s: (files[s.file], _natural_key(s.name)))


def _check_sizes(sources: list[_Source], to: str, block: int, group: int) -> None:
    if to == "fp8":
        if block <= 0:
            raise QuantizeError(
                f"--block must be a positive number of rows and columns, not {block}"
            )
        for s in sources:
            if s.quantized and (s.shape[0] % block or s.shape[1] % block):
                sizes = "the hidden, head and intermediate sizes" + (
                    ", and the vocabulary for --lm-head" if s.name == LM_HEAD else ""
                )
                raise QuantizeError(
                    f"block {block} does not divide {s.name} {list(s.shape)}: transformers and "
                    "vLLM load FP8 folders only when the block divides every projection's rows "
                    f"and columns ({sizes}); pick a block that does"
                )
    else:
        if group <= 0 or group % 8:
            raise QuantizeError(f"--group must be a positive multiple of 8, not {group}")
        for s in sources:
            if s.quantized and s.shape[1] % group:
                raise QuantizeError(
                    f"group {group} does not divide the {s.shape[1]} input columns of {s.name}: "
                    "int4 groups must divide every projection's input size; pick a group that does"
                )


def _outputs(s: _Source, to: str, block: int, group: int) -> list[tuple[str, str, tuple]]:
    """What tensor `s` becomes on disk: (name, safetensors dtype, shape) of each tensor written."""
    if not s.quantized:
        return [(s.name, s.dtype, s.shape)]
    out_f, in_f = s.shape
    if to == "fp8":
        grid = (math.ceil(out_f / block), math.ceil(in_f / block))
        return [(s.name, "F8_E4M3", s.shape), (s.name + SCALE_SUFFIX, "F32", grid)]
    return [
        (s.name + "_packed", "I32", (out_f, in_f // 8)),
        (s.name + "_scale", "BF16", (out_f, in_f // group)),
        (s.name + "_shape", "I32", (2,)),
    ]


def _nbytes(dtype: str, shape: tuple) -> int:
    return math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]


def _shard_plan(sources: list[_Source], sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Consecutive sources grouped into shards of at most max_bytes (a larger tensor gets one of
    its own); a weight and its scales stay in one shard."""
    shards: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    return shards


def _converted(s: _Source, t: torch.Tensor, to: str, block: int, group: int) -> dict:
    if not s.quantized:
        return {s.name: t}
    if to == "fp8":
        q, scale = quantize(t, block)
        return {s.name: q, s.name + SCALE_SUFFIX: scale}
    return int4.store(s.name, t, group)


class _ShardWriter:
    """One safetensors file written a tensor at a time: the header is laid out from the planned
    names, dtypes and shapes, and each tensor's bytes go to their offset as it is computed, so
    memory holds one tensor, whatever the shard's size. Tensors are laid out as safetensors does
    (widest elements first, then by name), so every tensor starts aligned to its element size."""

    def __init__(self, path: Path, planned: list[tuple[str, str, tuple]]):
        order = sorted(planned, key=lambda p: (-SAFETENSORS_ITEMSIZE[p[1]], p[0]))
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in order:
            end = offset + _nbytes(dtype, shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self.header = header
        self.size = offset
        self.pending = {name for name, _, _ in planned}
        self.path = path
        self.file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.file.write(len(text).to_bytes(8, "little") + text)
        self.start = 8 + len(text)

    def write(self, name: str, t: torch.Tensor) -> None:
        entry = self.header[name]
        if _DTYPE_NAMES.get(t.dtype) != entry["dtype"] or list(t.shape) != entry["shape"]:
            raise RuntimeError(
                f"{name}: computed {t.dtype} {list(t.shape)}, planned {entry['dtype']} "
                f"{entry['shape']}"
            )
        begin, _ = entry["data_offsets"]
        self.file.seek(self.start + begin)
        self.file.write(t.detach().cpu().contiguous().view(torch.uint8).numpy().data)
        self.pending.discard(name)

    def close(self) -> None:
        if self.pending:
            raise RuntimeError(f"tensors planned but not written: {sorted(self.pending)[:3]}")
        self.file.truncate(self.start + self.size)
        self.file.close()


def _check_dst(dst: Path) -> None:
    if os.path.lexists(dst):
        what = "a symbolic link" if dst.is_symlink() else "exists"
        raise QuantizeError(f"{dst} {what}: quantize writes a new folder and never overwrites one")
    if not dst.parent.is_dir():
        raise QuantizeError(f"{dst.parent} is not a folder: create it first")


def _read_config(src: Path) -> dict:
    path = src / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise QuantizeError(
            f"{src} has no config.json: is it a Hugging Face model folder?"
        ) from exc
    except ValueError as exc:
        raise QuantizeError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise QuantizeError(f"{path} is not a JSON object")
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise QuantizeError(
            f"{src} is already quantized (quantization_config {method!r}): give a bf16, fp16 or "
            "fp32 folder"
        )
    try:
        ModelConfig.from_dict(config)
    except ModelFormatError as exc:
        raise QuantizeError(f"{src}: {exc}") from exc
    return config


def quantize_folder(
    src: str | Path,
    dst: str | Path,
    to: str,
    block: int = DEFAULT_BLOCK,
    group: int = DEFAULT_GROUP,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    lm_head: bool = False,
) -> QuantizeSummary:
    """Write `dst`, a new folder holding `src`'s model with its projections quantized to `to`
    ("fp8": blocks of `block` x `block`; "int4": groups of `group` input columns), its weights in
    shards of at most `max_shard_bytes` (with an index when there are several), and src's other
    files (tokenizer, generation config, ...) copied. `lm_head`: its own lm_head is quantized too
    (a model that ties it to the embedding is refused). QuantizeError, before anything is
    written, when a folder or setting is refused; dst is never overwritten."""
    src, dst = Path(src), Path(dst)
    if to not in FORMATS:
        raise QuantizeError(f"unknown format {to!r}; expected one of {', '.join(FORMATS)}")
    if sys.byteorder != "little":  # safetensors is little-endian; tensors are written as in memory
        raise QuantizeError("quantize writes safetensors on little-endian machines only")
    if max_shard_bytes <= 0:
        raise QuantizeError("the shard size must be positive")
    if not src.is_dir():
        raise QuantizeError(f"{src} is not a folder")
    _check_dst(dst)
    config = _read_config(src)
    sources = _sources(src, lm_head)
    if not sources:
        raise QuantizeError(f"{src} holds no tensors")
    if lm_head and config.get("tie_word_embeddings"):
        raise QuantizeError(
            f"{src} ties its lm_head to the embedding, which stays as stored: --lm-head applies "
            "to models with an lm_head of their own"
        )
    if lm_head and not any(s.quantized and s.name == LM_HEAD for s in sources):
        raise QuantizeError(f"{src} holds no {LM_HEAD} to quantize")
    _check_sizes(sources, to, block, group)
    sizes = _planned_sizes(sources, to, block, group)
    free = shutil.disk_usage(dst.parent).free
    if sum(sizes) > free:
        raise QuantizeError(
            f"{dst.parent} has {free / 1e9:.2f} GB free; the quantized weights need "
            f"{sum(sizes) / 1e9:.2f} GB"
        )
    routers = [s.name.removesuffix(".weight") for s in sources if s.name.endswith(ROUTER_SUFFIX)]
    if to == "fp8":
        config["quantization_config"] = fp8_quantization_config(config, block, routers, lm_head)
    else:
        config["quantization_config"] = int4.quantization_config(
            group, int4_ignore(config, routers, lm_head)
        )

    # A hidden sibling: same file system, so the final rename is atomic.
    tmp = dst.parent / f".{dst.name}.quantize-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        written, shards = _write_weights(tmp, sources, to, block, group, max_shard_bytes)
        _copy_other_files(src, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _move_into_place(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return QuantizeSummary(
        dst=dst,
        quantized=sum(s.quantized for s in sources),
        tensors=len(sources),
        bytes_before=sum(s.nbytes for s in sources),
        bytes_after=written,
        shards=shards,
    )


def _planned_sizes(sources: list[_Source], to: str, block: int, group: int) -> list[int]:
    return [
        sum(_nbytes(dtype, shape) for _, dtype, shape in _outputs(s, to, block, group))
        for s in sources
    ]


def _source_tensors(sources: list[_Source]):
    """(source, tensor) in order, each file opened once (sources come grouped by file) and
    closed when done: its mapping counts as resident memory while open."""
    for file, group in itertools.groupby(sources, key=lambda s: s.file):
        with safe_open(str(file), framework="pt") as f:
            for s in group:
                yield s, f.get_tensor(s.name)


def _write_weights(
    folder: Path,
    sources: list[_Source],
    to: str,
    block: int,
    group: int,
    max_shard_bytes: int,
) -> tuple[int, int]:
    """The shards (and index); returns (bytes of tensors written, number of shards)."""
    sizes = _planned_sizes(sources, to, block, group)
    plan = _shard_plan(sources, sizes, max_shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(plan) == 1
        else [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    )
    shard_of = {i: n for n, shard in enumerate(plan) for i in shard}
    weight_map: dict[str, str] = {}
    writer = None
    with contextlib.closing(_source_tensors(sources)) as tensors:
        try:
            for i, (s, t) in enumerate(tensors):
                n = shard_of[i]
                if writer is None or writer.path.name != names[n]:
                    if writer is not None:
                        writer.close()
                    planned = [o for j in plan[n] for o in _outputs(sources[j], to, block, group)]
                    writer = _ShardWriter(folder / names[n], planned)
                for name, out in _converted(s, t, to, block, group).items():
                    writer.write(name, out)
                    weight_map[name] = names[n]
            writer.close()
        finally:
            if writer is not None:
                writer.file.close()
    if len(plan) > 1:
        index = {
            "metadata": {"total_size": sum(sizes)},
            "weight_map": dict(sorted(weight_map.items(), key=lambda kv: _natural_key(kv[0]))),
        }
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return sum(sizes), len(plan)


def _copy_other_files(src: Path, folder: Path) -> None:
    """The folder's other top-level files (tokenizer, generation config, license, README), read
    through links (a Hugging Face cache snapshot is links into its blobs); not the weights, their
    index or config.json, which quantize writes; not hidden files or sub-folders."""
    for path in sorted(src.iterdir()):
        if (
            path.name.startswith(".")
            or path.name == "config.json"
            or WEIGHT_FILE.fullmatch(path.name)
            or not path.is_file()
        ):
            continue
        shutil.copyfile(path, folder / path.name)


def _move_into_place(tmp: Path, dst: Path) -> None:
    """Rename the finished folder to dst without replacing anything that appeared there since the
    start: claim the name with mkdir (which fails on any existing entry, a link included), then
    rename over that empty folder of ours (which fails if anyone wrote into it)."""
    try:
        dst.mkdir()
    except FileExistsError as exc:
        raise QuantizeError(
            f"{dst} appeared while quantizing: quantize never overwrites a folder"
        ) from exc
    try:
        os.rename(tmp, dst)
    except OSError:
        try:
            dst.rmdir()  # ours, still empty (rmdir refuses otherwise)
        except OSError:
            pass
        raise
