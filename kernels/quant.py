"""Quantized weights as the kernels read them: a checkpoint's own format, kept in memory.

- `Fp8Weight`, block-scaled FP8 (the format of Qwen's FP8 releases): `data` [..., N, K]
  float8_e4m3fn and `scale` [..., ceil(N/bn), ceil(K/bk)] fp32 (the checkpoint's
  `weight_scale_inv`), W = data * scale over each bn x bk block, the last blocks ragged.
- `Int4Weight`, compressed-tensors' pack-quantized W4A16: `packed` [..., N, K/8] int32 (value j of
  a word at bits 4j..4j+3, stored as q + 8) and `scale` [..., N, K/G], W = q * scale over each
  group of G input columns.

Leading dimensions are experts (MoE weights [E, N, K]). `dequantize` is the reference the
kernels are tested against and the path for shapes no kernel takes; it is exact in fp32.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
PACK = 8  # int4 values per int32 word


@dataclass(frozen=True)
class Fp8Weight:
    data: torch.Tensor  # float8_e4m3fn [..., N, K]
    scale: torch.Tensor  # fp32 [..., ceil(N / block[0]), ceil(K / block[1])]
    block: tuple[int, int]  # (rows, columns) of one scale's block

    def __post_init__(self):
        rows, cols = self.block
        grid = (-(-self.data.shape[-2] // rows), -(-self.data.shape[-1] // cols))
        if self.data.dtype != FP8:
            raise ValueError(f"fp8 weight must be float8_e4m3fn, got {self.data.dtype}")
        if tuple(self.scale.shape) != (*self.data.shape[:-2], *grid):
            raise ValueError(
                f"fp8 weight {tuple(self.data.shape)} in blocks of {rows}x{cols} needs a scale "
                f"grid {grid}, got {tuple(self.scale.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def parts(self) -> tuple[torch.Tensor, ...]:
        return self.data, self.scale

    def replace(self, data: torch.Tensor, scale: torch.Tensor) -> Fp8Weight:
        return Fp8Weight(data, scale, self.block)


@dataclass(frozen=True)
class Int4Weight:
    packed: torch.Tensor  # int32 [..., N, K / 8]
    scale: torch.Tensor  # float [..., N, K / group]
    group: int

    def __post_init__(self):
        *lead, n, words = self.packed.shape
        k = words * PACK
        if (
            self.packed.dtype != torch.int32
            or self.group <= 0
            or self.group % PACK
            or k % self.group
            or tuple(self.scale.shape) != (*lead, n, k // self.group)
            or not self.scale.is_floating_point()
        ):
            raise ValueError(
                f"int4 weight packed {self.packed.dtype} {tuple(self.packed.shape)} in groups of "
                f"{self.group} needs int32 words and float scales [..., {n}, {k}/group], "
                f"got {self.scale.dtype} {tuple(self.scale.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], self.packed.shape[-1] * PACK))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def parts(self) -> tuple[torch.Tensor, ...]:
        return self.packed, self.scale

    def replace(self, packed: torch.Tensor, scale: torch.Tensor) -> Int4Weight:
        return Int4Weight(packed, scale, self.group)


QuantWeight = Fp8Weight | Int4Weight
Weight = torch.Tensor | Fp8Weight | Int4Weight


def is_quantized(w) -> bool:
    return isinstance(w, (Fp8Weight, Int4Weight))


def weight_shape(w: Weight) -> torch.Size:
    return w.shape


def nbytes(w: Weight) -> int:
    """Bytes the weight holds in memory (what a step streams to read it once)."""
    parts = w.parts() if is_quantized(w) else (w,)
    return sum(t.numel() * t.element_size() for t in parts)


def to(w: Weight, device) -> Weight:
    if not is_quantized(w):
        return w.to(device)
    return w.replace(*(t.to(device) for t in w.parts()))


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 words [..., K/8] -> int8 values [..., K] in [-8, 7]."""
    packed = packed.contiguous()  # the byte view below reads the words' memory in order
    if sys.byteorder != "little":
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
        return (((packed[..., None] >> shifts) & 0xF) - 8).flatten(-2).to(torch.int8)
    # Value 2j is byte j's low nibble and 2j+1 its high one: one mask and one shift over a byte
    # view instead of eight shifts of each word.
    nibbles = packed.view(torch.uint8)
    return torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).view(torch.int8).flatten(-2) - 8


def dequantize(w: Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full-precision weight [..., N, K] (exact in fp32; in bf16 for the project's own
    quantizer's scales)."""
    if isinstance(w, Fp8Weight):
        n, k = w.data.shape[-2:]
        rows = torch.arange(n, device=w.device) // w.block[0]
        cols = torch.arange(k, device=w.device) // w.block[1]
        scale = w.scale.float().index_select(-2, rows).index_select(-1, cols)
        return (w.data.float() * scale).to(dtype)
    if isinstance(w, Int4Weight):
        q = unpack_int4(w.packed).float()
        scaled = q.unflatten(-1, (w.scale.shape[-1], -1)) * w.scale.float()[..., None]
        return scaled.flatten(-2).to(dtype)
    return w.to(dtype)


def stack(weights: list[Weight]) -> Weight:
    """Experts' weights [N, K] each -> one [E, N, K] weight of the same kind."""
    first = weights[0]
    if not is_quantized(first):
        return torch.stack(weights)
    if any(type(w) is not type(first) for w in weights):
        raise ValueError("cannot stack weights of different formats")
    return first.replace(*(torch.stack(ts) for ts in zip(*(w.parts() for w in weights))))


def cat_rows(weights: list[Weight]) -> Weight | None:
    """Weights [..., N_i, K] -> [..., sum N_i, K] (q/k/v, or gate and up, fused), or None where
    the format cannot join them: FP8 blocks that would straddle two of them."""
    first = weights[0]
    if not is_quantized(first):
        return torch.cat(weights, dim=-2)
    if any(type(w) is not type(first) for w in weights):
        return None
    if isinstance(first, Fp8Weight):
        if any(w.block != first.block for w in weights) or any(
            w.shape[-2] % first.block[0] for w in weights[:-1]
        ):
            return None
    return first.replace(*(torch.cat(ts, dim=-2) for ts in zip(*(w.parts() for w in weights))))


def select_experts(w: Weight, start: int, stop: int) -> Weight:
    """Experts start..stop-1 of an [E, N, K] weight, as a copy (the rest can be freed)."""
    if not is_quantized(w):
        return w[start:stop].clone()
    return w.replace(*(t[start:stop].clone() for t in w.parts()))


# How a kernel reads a weight (its FORMAT constexpr).
PLAIN, FP8_BLOCKS, INT4_GROUPS = 0, 1, 2


@dataclass(frozen=True)
class KernelWeight:
    """A weight as a Triton kernel takes it: the stored tensor (elements, or int4 words) with its
    last dim contiguous, the scales (the stored tensor again where there are none) and the
    format's constants."""

    stored: torch.Tensor
    scale: torch.Tensor
    format: int
    scale_rows: int  # rows sharing a scale (FP8 block rows; 1 otherwise)
    scale_cols: int  # input columns sharing a scale (FP8 block columns, int4 group; 1 otherwise)
    per_item: int  # weights per stored item (8 int4 values per word; 1 otherwise)

    @property
    def tile_cols(self) -> int:
        """Columns a tile must stay within: an int4 group (one scale per row and tile); FP8
        kernels read a scale per column, so any tile width."""
        return self.scale_cols if self.format == INT4_GROUPS else 1

    def warp_tile_cols(self, block: int) -> int:
        """Warp decode's step of at most `block` input columns: within one int4 group, or whole
        groups where the group is a power of two (the kernels then read a scale per word);
        any width for FP8 and plain weights. At least two words."""
        groups = self.format == INT4_GROUPS and self.scale_cols & (self.scale_cols - 1) == 0
        cols = block if groups and block >= self.scale_cols else scale_tile(block, self.tile_cols)
        return max(cols, 2 * self.per_item)


# The kernels' narrowest tile along the input columns: one scale per tile, two words or more.
MIN_TILE_COLS = 2 * PACK


def kernels_read(w: Weight) -> bool:
    """Whether the Triton kernels take this weight as stored: a tile (a power of two of columns)
    must fit within one int4 group, and hold two words or more."""
    if isinstance(w, Int4Weight):
        return scale_tile(MIN_TILE_COLS, w.group) == MIN_TILE_COLS
    return True


def kernel_weight(w: Weight) -> KernelWeight:
    if not kernels_read(w):
        raise ValueError(f"int4 groups of {w.group}: the kernels need groups of 16k columns")

    def contiguous(t):
        return t if t.stride(-1) == 1 else t.contiguous()

    if isinstance(w, Fp8Weight):  # bytes: masked loads fill zeros, which fp8 can't take
        stored = contiguous(w.data).view(torch.uint8)
        return KernelWeight(stored, contiguous(w.scale), FP8_BLOCKS, w.block[0], w.block[1], 1)
    if isinstance(w, Int4Weight):
        return KernelWeight(
            contiguous(w.packed), contiguous(w.scale), INT4_GROUPS, 1, w.group, PACK
        )
    w = contiguous(w)
    return KernelWeight(w, w, PLAIN, 1, 1, 1)


def scale_tile(block: int, span: int) -> int:
    """The largest power-of-two tile <= block that divides `span` (the rows or columns that share
    one scale), so that one tile never straddles two scales; `block` where nothing is shared."""
    if span <= 1:
        return block
    return min(block, span & -span)


def format_name(w: Weight) -> str:
    """ "fp8", "int4", or "bf16" for an unquantized weight (the tuned tables' names)."""
    if isinstance(w, Fp8Weight):
        return "fp8"
    if isinstance(w, Int4Weight):
        return "int4"
    return "bf16"
