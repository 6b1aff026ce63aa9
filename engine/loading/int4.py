"""Group-scaled int4 weights, in the "pack-quantized" checkpoint format of compressed-tensors
(W4A16, symmetric, one scale per group of `group` input columns), as llm-compressor writes it and
transformers (with the compressed-tensors package) reads it.

A quantized weight W [out, in] is stored as
  `weight_packed` int32 [out, in / 8]: eight 4-bit values per word, value j at bits 4j..4j+3,
                  each stored as q + 8 (q in [-8, 7]);
  `weight_scale`  float (bf16 here) [out, in / group];
  `weight_shape`  int32 or int64 [2], the unpacked shape;
and W = q * scale broadcast over its group.

Our quantizer picks scales with at most 4 significant bits: every product q * scale then has at
most 7, so it is exact in bf16, and this engine, transformers and the training-time fake
quantization all see bit-identical weights, in fp32 and bf16.
"""

from __future__ import annotations

import torch

from kernels.quant import Int4Weight, stack, unpack_int4

SUFFIXES = ("_packed", "_scale", "_shape")  # appended to a weight's name ("...proj.weight_packed")
Q_MAX = 7  # our quantizer writes |q| <= 7; other writers also use -8, which reading takes
SCALE_BITS = 4  # significant bits of a scale (see above)
MIN_SCALE = 2.0**-100  # an all-zero group keeps a normal scale


def _check(w: torch.Tensor, group: int) -> None:
    if w.ndim != 2 or group <= 0 or group % 8 or w.shape[1] % group:
        raise ValueError(
            f"int4 needs [out, in] weights with in divisible by the group ({group}, a multiple "
            f"of 8), got {tuple(w.shape)}"
        )


def group_scales(w: torch.Tensor, group: int) -> torch.Tensor:
    """[out, in / group] scales: the group's largest magnitude over Q_MAX, rounded to the nearest
    value of SCALE_BITS significant bits. That moves it by at most 1/16, so the largest magnitude
    still rounds to +-Q_MAX (|w| / scale < 7.5): weights read back from a checkpoint quantize to the
    same scales and values again (a run resumed from an export trains on what was shipped)."""
    amax = w.float().unflatten(1, (-1, group)).abs().amax(dim=2)
    s = (amax / Q_MAX).clamp(min=MIN_SCALE)
    unit = torch.exp2(torch.floor(torch.log2(s)) - (SCALE_BITS - 1))
    return torch.round(s / unit) * unit


def quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] (rounded to bf16 first, the precision checkpoints keep) -> (q int8 [out, in]
    in [-7, 7], scale fp32 [out, in / group], exact in bf16)."""
    _check(w, group)
    w16 = w.detach().to(torch.bfloat16).float()
    scale = group_scales(w16, group)
    q = torch.round(w16.unflatten(1, (-1, group)) / scale[..., None]).clamp_(
        -Q_MAX, Q_MAX
    )  # past 7: < 0.5 step
    return q.flatten(1).to(torch.int8), scale


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] in [-8, 7] -> int32 [out, in / 8], the format's layout."""
    nibbles = (q.to(torch.int32) + 8).unflatten(1, (-1, 8))
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    # Bit 31 is the last nibble's top bit: the sum is formed in int64 and wrapped to int32.
    words = (nibbles.to(torch.int64) << shifts.to(torch.int64)).sum(dim=2)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def unpack(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of `pack`: int8 [out, in]."""
    out_f, in_f = shape
    if in_f % 8:
        raise ValueError(f"int4 weight {tuple(shape)}: its columns must be a multiple of 8")
    if packed.dtype != torch.int32 or tuple(packed.shape) != (out_f, in_f // 8):
        raise ValueError(
            f"int4 weight {tuple(shape)} needs packed int32 [{out_f}, {in_f // 8}], "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )
    return unpack_int4(packed)


def _scaled(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [out, in] times its group's scale [out, in / group], in fp32 (exact for our scales)."""
    return (q.float().unflatten(1, (scale.shape[1], -1)) * scale.float()[..., None]).flatten(1)


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, shape, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """W [out, in] from the stored tensors."""
    out_f, in_f = (int(n) for n in shape)
    q = unpack(packed, (out_f, in_f))
    if scale.ndim != 2 or scale.shape[0] != out_f or scale.shape[1] == 0 or in_f % scale.shape[1]:
        raise ValueError(
            f"int4 weight {(out_f, in_f)} needs a scale per row and group, got {tuple(scale.shape)}"
        )
    if not scale.is_floating_point():
        raise ValueError(f"int4 scales must be floating point, got {scale.dtype}")
    scale = scale.float()
    if not (torch.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError("int4 scales must be finite and positive")
    return _scaled(q, scale).to(dtype)


def store(name: str, w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of weight `name` ("...proj.weight")."""
    q, scale = quantize(w, group)
    return {
        name + "_packed": pack(q),
        name + "_scale": scale.to(torch.bfloat16),
        name + "_shape": torch.tensor(w.shape, dtype=torch.int32),
    }


def fake_quantize(w: torch.Tensor, group: int) -> torch.Tensor:
    """Training: W rounded through int4 (from its bf16 value, as `quantize`) in the forward pass,
    gradients straight through to W, which keeps its full precision."""
    q, scale = quantize(w, group)
    rounded = _scaled(q, scale).to(w.dtype)
    return w + (rounded - w).detach()


def config_group_size(config: dict) -> int | None:
    """The group size of a compressed-tensors int4 checkpoint from its config.json; None if the
    checkpoint is not one; ValueError for a compressed-tensors scheme this engine does not read
    (anything beyond weight-only symmetric int4 groups would change what the weights mean)."""
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "compressed-tensors":
        return None
    groups = quant.get("config_groups")
    if not (
        isinstance(groups, dict)
        and len(groups) == 1
        and isinstance(next(iter(groups.values())), dict)
    ):
        raise ValueError(
            "compressed-tensors: only one config group, spelled out as a scheme (int4 weights), "
            f"is supported, got {groups!r}"
        )
    for key in ("transform_config", "kv_cache_scheme", "sparsity_config"):
        if quant.get(key):  # rotations, quantized KV or sparse weights: not weight-only int4
            raise ValueError(f"compressed-tensors: {key} is not supported")
    if quant.get("quantization_status", "compressed") != "compressed":
        raise ValueError(
            f"compressed-tensors: only compressed checkpoints load, not "
            f"{quant.get('quantization_status')!r} ones"
        )
    scheme = next(iter(groups.values()))
    weights = scheme.get("weights") or {}
    size = weights.get("group_size")
    fmt = scheme.get("format") or quant.get("format")
    if not (
        fmt == "pack-quantized"
        and weights.get("num_bits") == 4
        and weights.get("type", "int") == "int"
        and weights.get("symmetric", True)
        and weights.get("strategy", "group") == "group"
        and not weights.get("dynamic")
        and scheme.get("input_activations") is None
        and scheme.get("output_activations") is None
    ):
        raise ValueError(
            f"compressed-tensors: only symmetric int4 group weights (W4A16, pack-quantized) "
            f"are supported, got {scheme!r}"
        )
    if not (type(size) is int and size > 0):
        raise ValueError(f"compressed-tensors: bad group_size {size!r}")
    return size


def quantization_config(group: int, ignore: list[str]) -> dict:
    """config.json's `quantization_config` for weights stored by `store`."""
    scheme = {
        "targets": ["Linear"],
        "format": "pack-quantized",
        "input_activations": None,
        "output_activations": None,
        "weights": {
            "num_bits": 4,
            "type": "int",
            "symmetric": True,
            "strategy": "group",
            "group_size": group,
            "dynamic": False,
            "actorder": None,
            "observer": "minmax",
        },
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": scheme},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def quantized_weight(w: torch.Tensor, group: int) -> Int4Weight:
    """W [..., out, in] (leading dims: experts) as the kernels' group-scaled int4 weight."""
    if w.ndim > 2:
        return stack([quantized_weight(part, group) for part in w])
    q, scale = quantize(w, group)
    return Int4Weight(pack(q), scale.to(torch.bfloat16), group)
