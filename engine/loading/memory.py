"""The GPU memory a model needs, known before it loads, and the KV pool's share of a cap.

- `checkpoint_weight_bytes`: a model folder's weights on a device, from config.json and the
  safetensors headers alone (no tensor is read); `config_weight_bytes`: the same from a config
  dict and a quantization format (random-weight shapes, and what a quantized copy would take).
  On CUDA FP8 and int4 weights stay as stored (kernels.quant: FP8 one byte an element plus fp32
  block scales, int4 half a byte plus its scales in their stored dtype) and every other weight
  (embedding, lm_head, routers, norms) is held in the run dtype; on the CPU every weight is
  dequantized to the run dtype.
- `check_before_load` (`gpu_budget`, then `check_fits`): `--gpu-memory-gb` (set as the
  allocator's per-process fraction; else the GPU's free memory) against the weights, a minimal KV
  pool and the activations' reserve, before loading, with an error that names what is needed,
  the budget and the quantization that would fit.
- `capped_kv_pool_bytes`: under a cap, the KV pool takes what is left after the weights and the
  reserve; `describe`: the daemon's log line on the weights' and the pool's gigabytes.

GB here are 10^9 bytes, as in `--gpu-memory-gb`.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.model.config import ModelConfig, ModelFormatError

GB = 10**9
# What a quantized copy is assumed to use (`wd-engine quantize`): the blocks of Qwen's FP8
# releases, and compressed-tensors' usual W4A16 group.
FP8_BLOCK = 128
INT4_GROUP = 128
# Memory beside the weights and the KV pool that serving needs: one prefill chunk's transients
# (2048 tokens on CUDA: the MoE's routed rows and their gate/up outputs, attention's keys and
# values widened to every query head over the whole context), the CUDA graphs' pools, cuBLAS and
# Triton workspaces, a quantized layer's tiles dequantized for prefill, and the caching allocator's
# rounding and fragmentation. Meant to cover a 30B-A3B model at the daemon's default prompt
# limit (engine.bench.fit measures the peak under a cap on a GPU); small beside a GPU's memory.
RESERVE_BYTES = 2 * GB
# The smallest KV pool worth serving with: a full prompt (the daemon's default limit is 4096
# tokens) and its completion, with room for a second editor's prompt beside it.
MIN_KV_TOKENS = 8192

FORMAT_LABELS = {"fp8": "FP8", "int4": "int4"}
QUANT_FORMATS = tuple(FORMAT_LABELS)
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# safetensors' dtype names -> bytes per element
SAFETENSORS_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
_HEADER_LIMIT = 100 << 20  # safetensors' own bound on a header


class NotEnoughGpuMemory(ModelFormatError):
    """The model (or the KV pool asked for) does not fit the GPU memory allowed; the message
    says how much is needed, the budget, and what would fit."""


@dataclass(frozen=True)
class WeightBytes:
    total: int  # bytes the weights take on the device
    format: str  # "fp8", "int4", or the run dtype's short name ("bf16", "fp32", "fp16")


@dataclass(frozen=True)
class GpuBudget:
    device: str
    bytes: int  # what the process may use on the device
    what: str  # says where the figure comes from: "allowed (--gpu-memory-gb)", "free on cuda:0"
    capped: bool  # set by --gpu-memory-gb (else the free memory, and the KV pool keeps its default)


@dataclass(frozen=True)
class _Weight:
    """A weight as the model holds it, and the checkpoint tensors it is read from."""

    shape: tuple[int, ...]  # q/k/v and gate/up joined, experts stacked
    parts: tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape) in the checkpoint
    # "plain": held in the run dtype; "projection": what `wd-engine quantize` quantizes, kept
    # quantized on CUDA; "head": an own lm_head, kept quantized where stored so
    role: str
    joined_rows: tuple[int, ...] = ()  # rows of each part joined to a next one


def dtype_name(dtype, device_type: str = "cuda") -> str:
    """The dtype's name (float32, bfloat16 or float16) from a name or a torch dtype; auto as the
    loader reads it: fp32 on the CPU, bf16 on a GPU."""
    name = str(dtype).removeprefix("torch.") if dtype is not None else "auto"
    if name == "auto":
        return "float32" if device_type == "cpu" else "bfloat16"
    if name not in _ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(_ITEMSIZE)}")
    return name


def _plain(name: str, *shape: int) -> _Weight:
    return _Weight(shape, ((name, shape),), "plain")


def _weights(
    cfg: ModelConfig, has: Callable[[str], bool] = lambda name: False
) -> Iterator[_Weight]:
    """The model's weights as engine.loading.loader builds them; `has` tells whether the
    checkpoint holds a name (an o_proj bias, experts fused on disk)."""
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_heads * d, cfg.num_kv_heads * d
    yield _plain("model.embed_tokens.weight", cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        qkv = tuple((f"{attn}{x}_proj.weight", (n, h)) for x, n in zip("qkv", (hq, hkv, hkv)))
        yield _Weight((hq + 2 * hkv, h), qkv, "projection", (hq, hkv))
        if cfg.attention_bias:
            for x, n in zip("qkv", (hq, hkv, hkv)):
                yield _plain(f"{attn}{x}_proj.bias", n)
            if has(attn + "o_proj.bias"):
                yield _plain(attn + "o_proj.bias", h)
        yield _Weight((h, hq), ((attn + "o_proj.weight", (h, hq)),), "projection")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield _plain(f"{p}{norm}.weight", h)
        yield _plain(attn + "q_norm.weight", d)
        yield _plain(attn + "k_norm.weight", d)
        if not cfg.is_moe_layer(i):
            inter = cfg.intermediate_size
            gate_up = tuple((f"{p}mlp.{x}_proj.weight", (inter, h)) for x in ("gate", "up"))
            yield _Weight((2 * inter, h), gate_up, "projection", (inter,))
            yield _Weight((h, inter), ((p + "mlp.down_proj.weight", (h, inter)),), "projection")
            continue
        e, inter = cfg.num_experts, cfg.moe_intermediate_size
        yield _plain(p + "mlp.gate.weight", e, h)
        if has(p + "mlp.experts.gate_up_proj"):  # fused on disk: read whole, in the run dtype
            yield _plain(p + "mlp.experts.gate_up_proj", e, 2 * inter, h)
            yield _plain(p + "mlp.experts.down_proj", e, h, inter)
            continue
        experts = [f"{p}mlp.experts.{n}." for n in range(e)]
        gate_up = tuple(
            (x + f"{g}_proj.weight", (inter, h)) for x in experts for g in ("gate", "up")
        )
        yield _Weight((e, 2 * inter, h), gate_up, "projection", (inter,))
        down = tuple((x + "down_proj.weight", (h, inter)) for x in experts)
        yield _Weight((e, h, inter), down, "projection")
    yield _plain("model.norm.weight", h)
    if not cfg.tie_word_embeddings:  # tied: the head is the embedding, held once
        shape = (cfg.vocab_size, h)
        yield _Weight(shape, (("lm_head.weight", shape),), "head")


def fp8_bytes(shape: tuple[int, ...], block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> int:
    """A block-scaled FP8 weight [..., out, in]: one byte an element, an fp32 scale a block."""
    *lead, out_f, in_f = shape
    grid = math.ceil(out_f / block[0]) * math.ceil(in_f / block[1])
    return math.prod(lead) * (out_f * in_f + 4 * grid)


def int4_bytes(shape: tuple[int, ...], group: int = INT4_GROUP, scale_bytes: int = 2) -> int:
    """A group-scaled int4 weight [..., out, in]: eight values an int32 word, a scale (bf16, as
    this project and llm-compressor write them) a row and group."""
    *lead, out_f, in_f = shape
    return (
        math.prod(lead) * out_f * (4 * math.ceil(in_f / 8) + scale_bytes * math.ceil(in_f / group))
    )


def config_weight_bytes(
    config: dict | ModelConfig,
    quant: str | None = None,
    dtype="auto",
    device_type: str = "cuda",
    fp8_block: int = FP8_BLOCK,
    int4_group: int = INT4_GROUP,
    quant_lm_head: bool = False,
) -> WeightBytes:
    """The weights of a model of this config, its projections (attention, MLPs, experts; with
    `quant_lm_head` its own lm_head too) in `quant` ("fp8", "int4"; None: unquantized) and the
    rest in the run dtype: random weights of a named shape (engine.model.random_model, which
    quantizes the joined q/k/v and gate/up as one), or a quantized copy of a checkpoint. On the
    CPU quantized weights are dequantized."""
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(config)
    if quant not in (None, *QUANT_FORMATS):
        raise ValueError(f"unknown quantization {quant!r}; expected one of {QUANT_FORMATS}")
    name = dtype_name(dtype, device_type)
    itemsize = _ITEMSIZE[name]
    kept = quant if device_type == "cuda" else None
    total = 0
    quantized_roles = ("projection", "head") if quant_lm_head else ("projection",)
    for w in _weights(cfg):
        if w.role in quantized_roles and kept == "fp8":
            total += fp8_bytes(w.shape, (fp8_block, fp8_block))
        elif w.role in quantized_roles and kept == "int4":
            total += int4_bytes(w.shape, int4_group)
        else:
            total += math.prod(w.shape) * itemsize
    return WeightBytes(total, kept or _SHORT[name])


def read_headers(model_dir: str | Path) -> dict[str, dict]:
    """name -> {"dtype", "shape", ...} of every tensor of a folder's safetensors files (a sharded
    folder's through its index), read from the files' headers alone."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ModelFormatError(f"{index.name} is not a weight index: {exc}") from exc
        files = sorted({model_dir / shard for shard in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"no *.safetensors weights in {model_dir}")
    tensors = {}
    for path in files:
        tensors.update(_header(path))
    return tensors


def _header(path: Path) -> dict[str, dict]:
    """A safetensors file's header: a little-endian u64 length, then that much JSON."""
    if not path.is_file():
        raise ModelFormatError(f"weight shard {path.name} is listed in the index but missing")
    with path.open("rb") as f:
        prefix = f.read(8)
        size = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        if not 0 < size <= _HEADER_LIMIT:
            raise ModelFormatError(f"{path.name} is not a safetensors file")
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelFormatError(f"{path.name}: unreadable safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path.name}: unreadable safetensors header")
    header.pop("__metadata__", None)
    return header


def _elements(info: dict) -> int:
    return math.prod(info.get("shape", ()))


def _stored_bytes(info: dict) -> int:
    return _elements(info) * SAFETENSORS_ITEMSIZE.get(info.get("dtype"), 4)


def _stored_format(headers: dict[str, dict], name: str) -> str:
    if name + "_packed" in headers:
        return "int4"
    if name + "_scale_inv" in headers and name in headers:
        return "fp8"
    return "plain"


def _kept_bytes(w: _Weight, headers: dict[str, dict], fp8_rows: int) -> tuple[str, int] | None:
    """(format, bytes) of a weight the loader keeps quantized on CUDA, as stored (FP8 scales
    widened to fp32), or None where it dequantizes it: FP8 parts whose blocks would straddle
    a join, int4 groups the kernels do not read, parts in different formats."""
    from kernels.quant import MIN_TILE_COLS, scale_tile

    formats = {_stored_format(headers, name) for name, _ in w.parts}
    if len(formats) != 1 or formats == {"plain"}:
        return None
    fmt = formats.pop()
    total = 0
    for name, (_, in_f) in w.parts:
        if fmt == "fp8":
            total += _elements(headers[name]) + 4 * _elements(headers[name + "_scale_inv"])
            continue
        scale = headers.get(name + "_scale", {})
        groups = scale.get("shape", (0, 0))[-1]
        group = in_f // groups if groups else 0
        if scale_tile(MIN_TILE_COLS, group) != MIN_TILE_COLS:
            return None
        total += _stored_bytes(headers[name + "_packed"]) + _stored_bytes(scale)
    if fmt == "fp8" and any(rows % fp8_rows for rows in w.joined_rows):
        return None
    return fmt, total


def checkpoint_weight_bytes(
    model_dir: str | Path, dtype="auto", device_type: str = "cuda"
) -> WeightBytes:
    """A model folder's weights as engine.loading.loader will hold them on `device_type`, from
    config.json and the safetensors headers (no tensor is read): on CUDA its FP8 and int4
    projections as stored, everything else in the run dtype. A weight missing from the
    checkpoint counts at its config shape (the loader then names it)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    headers = read_headers(model_dir)
    name = dtype_name(dtype, device_type)
    itemsize = _ITEMSIZE[name]
    block = (cfg.raw.get("quantization_config") or {}).get("weight_block_size") or [FP8_BLOCK]
    total, formats = 0, set()
    for w in _weights(cfg, headers.__contains__):
        kept = None
        if device_type == "cuda" and w.role != "plain":
            kept = _kept_bytes(w, headers, int(block[0]))
        if kept is None:
            total += math.prod(w.shape) * itemsize
        else:
            formats.add(kept[0])
            total += kept[1]
    return WeightBytes(total, "+".join(sorted(formats)) if formats else _SHORT[name])


def kv_bytes_per_token(config: ModelConfig, dtype="bfloat16", kv_fp8: bool = False) -> int:
    """Bytes one cached token takes over all layers, K and V (engine.kv.pool.KVPool)."""
    elements = config.num_kv_heads * config.head_dim
    per_layer = 2 * (elements if kv_fp8 else elements * _ITEMSIZE[dtype_name(dtype)])
    if kv_fp8:
        per_layer += 2 * 4 * config.num_kv_heads  # an fp32 scale per (token, head), K and V
    return per_layer * config.num_layers


def _gb(n: int) -> str:
    """GB with one decimal; below a gigabyte (a small model), MB with three digits."""
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / 10**6:.3g} MB"


def fit_error(
    name: str,
    weights: WeightBytes,
    config: dict | ModelConfig,
    budget: GpuBudget,
    kv_bytes: int,
    how_to_quantize: Callable[[str], str],
    reserve_bytes: int = RESERVE_BYTES,
) -> str | None:
    """Why the weights, a KV pool of `kv_bytes` and the reserve do not fit `budget`, with what
    each smaller format would need and how to make the largest one that fits; None if they fit."""
    overhead = kv_bytes + reserve_bytes
    if weights.total + overhead <= budget.bytes:
        return None
    message = f"{name} needs {_gb(weights.total)} of GPU memory for its weights in {weights.format}"
    if weights.total <= budget.bytes:
        message += f" and {_gb(overhead)} more for a minimal KV cache and activations"
    message += f", more than the {_gb(budget.bytes)} {budget.what}"
    smaller = {
        fmt: config_weight_bytes(config, fmt).total
        for fmt in QUANT_FORMATS
        if QUANT_FORMATS.index(fmt) > _format_rank(weights.format)
    }
    smaller = {fmt: n for fmt, n in smaller.items() if n < weights.total}
    if not smaller:
        return message
    sizes = " and ".join(
        f"an {FORMAT_LABELS[fmt]} copy{' needs' if first else ''} ~{_rounded(n)}"
        for first, (fmt, n) in zip((True, False), smaller.items())
    )
    fitting = [fmt for fmt, n in smaller.items() if n + overhead <= budget.bytes]
    if fitting:
        return f"{message}; {sizes}: {how_to_quantize(fitting[0])}"
    none_fits = "neither fits" if len(smaller) > 1 else "that does not fit either"
    return f"{message}; {sizes}: {none_fits}, a GPU with more memory is needed"


def _rounded(n: int) -> str:
    """An estimate's size: whole GB (a quantized copy's layout may differ a little)."""
    return f"{n / GB:.0f} GB" if n >= GB else _gb(n)


def _format_rank(fmt: str) -> int:
    """-1 for unquantized weights, else the format's place in QUANT_FORMATS (a checkpoint mixing
    formats ranks as its smallest)."""
    ranks = [QUANT_FORMATS.index(f) for f in fmt.split("+") if f in QUANT_FORMATS]
    return max(ranks, default=-1)


def check_fits(
    name: str,
    weights: WeightBytes,
    config: dict | ModelConfig,
    budget: GpuBudget,
    kv_bytes: int,
    how_to_quantize: Callable[[str], str],
    reserve_bytes: int = RESERVE_BYTES,
) -> None:
    """NotEnoughGpuMemory (the message of `fit_error`) unless the model fits `budget`."""
    error = fit_error(name, weights, config, budget, kv_bytes, how_to_quantize, reserve_bytes)
    if error:
        raise NotEnoughGpuMemory(error)


def quantize_command(model_dir: str | Path, quantized: bool = False) -> Callable[[str], str]:
    """How to make a quantized copy of a model folder (`wd-engine quantize` reads unquantized
    folders: a `quantized` one's copy comes from the checkpoint it was made from)."""
    src = Path(model_dir)
    if quantized:
        return lambda fmt: f"`wd-engine quantize --to {fmt} SRC DST` of its unquantized checkpoint"
    return lambda fmt: (
        f"`wd-engine quantize --to {fmt} {src} {src.parent / (src.name + '-' + fmt)}`"
    )


def capped_kv_pool_bytes(
    budget: GpuBudget,
    used_bytes: int,
    requested_bytes: int | None,
    min_bytes: int,
    reserve_bytes: int = RESERVE_BYTES,
) -> int:
    """The KV pool under a cap: as asked (NotEnoughGpuMemory if it does not fit beside what is in
    use and the reserve), else all that is left, at least `min_bytes`."""
    left = budget.bytes - used_bytes - reserve_bytes
    taken = f"the model takes {_gb(used_bytes)} of the {_gb(budget.bytes)} {budget.what}"
    if requested_bytes is not None:
        if requested_bytes > left:
            raise NotEnoughGpuMemory(
                f"a KV pool of {_gb(requested_bytes)} (--kv-memory-mb) does not fit: {taken}, "
                f"which leaves {_gb(max(left, 0))} after {_gb(reserve_bytes)} for activations"
            )
        return requested_bytes
    if left < min_bytes:
        raise NotEnoughGpuMemory(
            f"no room for the KV cache: {taken}, which leaves {_gb(max(left, 0))} after "
            f"{_gb(reserve_bytes)} for activations, less than the {_gb(min_bytes)} a minimal "
            "KV cache needs"
        )
    return left


def gpu_budget(device, cap_gb: float | None, log) -> GpuBudget | None:
    """What this process may use on a CUDA device: `cap_gb` (set as the allocator's per-process
    fraction, so the KV pool and every later allocation stay under it), else the device's free
    memory; None off CUDA (where a cap applies to nothing: said once in `log`)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        if cap_gb is not None:
            log.warning("--gpu-memory-gb applies to CUDA devices; ignored on %s", device.type)
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    label = f"cuda:{index}"
    free, total = torch.cuda.mem_get_info(index)
    if cap_gb is None:
        return GpuBudget(label, free, f"free on {label}", capped=False)
    if not cap_gb > 0:
        raise ValueError(f"--gpu-memory-gb must be positive, got {cap_gb}")
    cap = int(cap_gb * GB)
    if cap > total:
        log.warning(
            "--gpu-memory-gb %.1f is more than %s has (%s): capped there", cap_gb, label, _gb(total)
        )
        cap = total
    torch.cuda.set_per_process_memory_fraction(cap / total, index)
    if free < cap:  # another process holds part of it
        return GpuBudget(
            label, free, f"free on {label} (under the {_gb(cap)} allowed)", capped=True
        )
    return GpuBudget(label, cap, "allowed (--gpu-memory-gb)", capped=True)


def gpu_bytes_in_use(device) -> int:
    """What this process's allocator holds on the device, its unused cached blocks returned
    first: what counts against the per-process fraction."""
    import torch

    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(torch.device(device))


def check_before_load(
    device,
    cap_gb: float | None,
    log,
    *,
    model_dir: str | Path | None = None,
    config: dict | None = None,
    quant: str | None = None,
    quant_lm_head: bool = False,
    dtype="auto",
    kv_bytes: int | None = None,
    name: str | None = None,
) -> GpuBudget | None:
    """Before a model loads on CUDA: the process's budget (`gpu_budget`), and NotEnoughGpuMemory
    unless the weights (of the folder `model_dir`, or of `config` with `quant` and
    `quant_lm_head` for random weights), a KV pool of `kv_bytes` (default: MIN_KV_TOKENS tokens)
    and the reserve fit it. None off CUDA."""
    budget = gpu_budget(device, cap_gb, log)
    if budget is None:
        return None
    if config is None:
        weights = checkpoint_weight_bytes(model_dir, dtype, "cuda")
        config = ModelConfig.from_dir(model_dir).raw
        how_to = quantize_command(model_dir, _format_rank(weights.format) >= 0)
        name = name or Path(model_dir).name
    else:
        weights = config_weight_bytes(config, quant, dtype, "cuda", quant_lm_head=quant_lm_head)
        how_to = lambda fmt: f"add `--quant {fmt}`"  # noqa: E731 - random weights
        name = name or "the model"
    if kv_bytes is None:
        per_token = kv_bytes_per_token(ModelConfig.from_dict(config), dtype_name(dtype, "cuda"))
        kv_bytes = MIN_KV_TOKENS * per_token
    check_fits(name, weights, config, budget, kv_bytes, how_to)
    return budget


def describe(model, pool=None, budget: GpuBudget | None = None) -> str:
    """The log's line on memory: the loaded weights (quantized ones as stored) and the KV pool."""
    from engine.model.qwen3_moe import weight_bytes

    line = f"weights {_gb(weight_bytes(model))}"
    if pool is not None:
        tokens = pool.num_blocks * pool.block_size
        line += f", KV pool {_gb(pool.bytes_per_token() * tokens)} ({tokens} tokens)"
    if budget is not None and budget.capped:
        line += f", under the {_gb(budget.bytes)} {budget.what}"
    return line
