"""Block-scaled FP8 weights, in the checkpoint format of Qwen's and DeepSeek's FP8 releases.

A quantized weight W [out, in] is stored as `weight` (float8_e4m3fn) plus `weight_scale_inv`
(fp32, one per block of `block` rows x `block` columns, the last blocks ragged), and
W = weight * scale_inv broadcast over its block. `config.json` names the format and the block:
`"quantization_config": {"quant_method": "fp8", "weight_block_size": [B, B], ...}`.

Our quantizer picks power-of-two scales: then every dequantized value (a 4-bit significand times
a power of two) is exact in bf16, so this project's engine, transformers and the training-time
fake quantization all see bit-identical weights, in any float dtype.
"""

from __future__ import annotations

import math

import torch

from kernels.quant import Fp8Weight, stack

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
MIN_SCALE_EXP = -100.0  # 2**-100: far below any weight's scale, far above fp32's subnormals


def _blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, int, int]:
    """[out, in] -> zero-padded [out/B, B, in/B, B] view, and the pads."""
    out_f, in_f = w.shape
    pad_o, pad_i = -out_f % block, -in_f % block
    padded = torch.nn.functional.pad(w, (0, pad_i, 0, pad_o))
    return (
        padded.view((out_f + pad_o) // block, block, (in_f + pad_i) // block, block),
        pad_o,
        pad_i,
    )


def block_scales(w: torch.Tensor, block: int) -> torch.Tensor:
    """Power-of-two scale per block, the smallest with |w| / scale <= FP8_MAX.

    Shape [ceil(out/B), ceil(in/B)]."""
    blocks, _, _ = _blocks(w.detach().float(), block)
    amax = blocks.abs().amax(dim=(1, 3))
    # An all-zero block would get a subnormal scale, which GPUs flush to 0 (0/0 = NaN): keep it
    # normal.
    return torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)).clamp(min=MIN_SCALE_EXP))


def _fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 blocks [out/B, B, in/B, B], scales) of W rounded to bf16 first, the precision training
    checkpoints keep: export and training round alike, so a bf16 checkpoint loses nothing."""
    w16 = w.detach().to(torch.bfloat16).float()
    scales = block_scales(w16, block)
    blocks, _, _ = _blocks(w16, block)
    return (blocks / scales[:, None, :, None]).to(FP8), scales


def _unblock(blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[out/B, B, in/B, B] -> [out, in], the padding cut off."""
    out_f, in_f = shape
    return blocks.reshape(blocks.shape[0] * blocks.shape[1], -1)[:out_f, :in_f]


def quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (fp8 weight [out, in], fp32 scale_inv [ceil(out/B), ceil(in/B)])."""
    q, scales = _fp8_blocks(w, block)
    return _unblock(q, w.shape).contiguous(), scales


def dequantize(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of `quantize`. `block` is the config's `weight_block_size` (rows, columns): the
    grid alone cannot tell it when the last blocks are ragged."""
    out_f, in_f = q.shape
    block_o, block_i = block
    grid = (math.ceil(out_f / block_o), math.ceil(in_f / block_i))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"fp8 weight {tuple(q.shape)} in blocks of {block_o}x{block_i} needs a scale grid "
            f"{grid}, got {tuple(scale_inv.shape)}"
        )
    scale_inv = scale_inv.float()
    if not (torch.isfinite(scale_inv).all() and (scale_inv > 0).all()):
        raise ValueError("fp8 scales must be finite and positive")
    # Index rather than repeat: a block size far larger than the weight allocates nothing.
    rows = torch.arange(out_f) // block_o
    cols = torch.arange(in_f) // block_i
    scale = scale_inv[rows][:, cols]
    return (q.float() * scale).to(dtype)


def block_size(config: dict) -> tuple[int, int] | None:
    """(rows, columns) of an fp8 checkpoint's blocks from its config.json, None if not fp8."""
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if not (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(type(n) is int and n > 0 for n in block)
    ):
        raise ValueError(
            f"fp8 quantization_config needs weight_block_size [rows, cols], got {block!r}"
        )
    rows, cols = block
    return rows, cols


def fake_quantize(w: torch.Tensor, block: int) -> torch.Tensor:
    """Training: W rounded through FP8 (from its bf16 value, as `quantize`) in the forward pass,
    gradients straight through to W, which keeps its full precision."""
    q, scales = _fp8_blocks(w, block)
    rounded = _unblock(q.float() * scales[:, None, :, None], w.shape).to(w.dtype)
    return w + (rounded - w).detach()


def quantized_weight(w: torch.Tensor, block: int) -> Fp8Weight:
    """W [..., out, in] (leading dims: experts) as the kernels' block-scaled FP8 weight."""
    if w.ndim > 2:
        return stack([quantized_weight(part, block) for part in w])
    data, scale = quantize(w, block)
    return Fp8Weight(data, scale, (block, block))
