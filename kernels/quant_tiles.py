"""Reading quantized weights (kernels.quant) in Triton: a loaded tile of stored items to the
values it holds, and a quantized tile into a dot. Shared by warp decode, the expert-centric
path and the skinny GEMV."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.quant import FP8_BLOCKS, INT4_GROUPS, KernelWeight, scale_tile

# An int4 nibble u OR'ed into the bits of the fp32 2**23 is the fp32 2**23 + u exactly (u sits in
# the mantissa's low bits), so one subtraction of 2**23 + 8 yields q = u - 8: no int->float
# conversion, which is a slow instruction.
INT4_FLOAT_BITS = tl.constexpr(0x4B000000)
INT4_FLOAT_BIAS = tl.constexpr(8388616.0)  # 2**23 + 8


@triton.jit
def int4_nibbles_to_float(nibbles):
    """int32 nibbles u in [0, 15] -> fp32 q = u - 8, exact."""
    return (nibbles | INT4_FLOAT_BITS).to(tl.float32, bitcast=True) - INT4_FLOAT_BIAS


@triton.jit
def int4_upper_half(words):
    """The words' upper 16 bits moved down, where `int4_plane` reads planes 4-7: one shift a
    word instead of one a plane (int32's >> copies the sign bit above them; no plane reads those
    copies)."""
    return words >> 16


@triton.jit
def int4_plane(words, upper, J: tl.constexpr):
    """Value J of every int32 word times 16**(J % 4), as fp32 (u - 8) * 16**(J % 4), exact, in the
    words' own shape: the weights of columns 8c + J of a tile whose words are c, for a caller that
    scales what they meet by `int4_plane_scale(J)`. The nibble is masked where it lies (in the
    words for J < 4, in their `int4_upper_half` for the rest), not shifted down: u * 16**(J % 4)
    < 2**16 still sits in 2**23's mantissa, so OR and one subtraction give it exactly."""
    if J < 4:
        nibble = words & (0xF << (4 * J))
    else:
        nibble = upper & (0xF << (4 * (J - 4)))
    return (nibble | INT4_FLOAT_BITS).to(tl.float32, bitcast=True) - (
        8388608.0 + 8.0 * (1 << (4 * (J % 4)))
    )


@triton.jit
def int4_plane_scale(J: tl.constexpr):
    """1 / 16**(J % 4): what a plane's partner is scaled by. A power of two, so the product is
    the unscaled one, rounded the same (for partners above 2**-114, which stay normal)."""
    return 1.0 / (1 << (4 * (J % 4)))


@triton.jit
def int4_values(words, COLS: tl.constexpr):
    """int32 words [..., COLS / 8] -> their 4-bit values [..., COLS] as fp32 in [-8, 7]: each
    word repeated eight times along the last dim, then shifted to its value's nibble (in column
    order, as tl.dot needs; kernels that need no dot read the words by `int4_plane`)."""
    words = tl.interleave(words, words)
    words = tl.interleave(words, words)
    words = tl.interleave(words, words)
    shifts = (tl.arange(0, COLS) % 8) * 4
    return int4_nibbles_to_float((words >> shifts) & 0xF)


@triton.jit
def fp8_column_scales(s_ptr, c0, n_cols, COLS: tl.constexpr, SCALE_COLS: tl.constexpr):
    """[COLS] FP8 scales of columns c0 .. c0 + COLS - 1 in the block row at s_ptr: one load when
    the step lies within a block, a load per block broadcast over its columns when it spans
    whole blocks, else a load per column."""
    if SCALE_COLS % COLS == 0:
        scales = tl.full([COLS], 1.0, tl.float32) * tl.load(s_ptr + c0 // SCALE_COLS)
    elif COLS % SCALE_COLS == 0 and (SCALE_COLS & (SCALE_COLS - 1)) == 0:
        blocks = tl.minimum(
            c0 // SCALE_COLS + tl.arange(0, COLS // SCALE_COLS), (n_cols - 1) // SCALE_COLS
        )
        per_block = tl.broadcast_to(
            tl.load(s_ptr + blocks)[:, None], [COLS // SCALE_COLS, SCALE_COLS]
        )
        scales = tl.reshape(per_block, [COLS])
    else:
        scales = tl.load(s_ptr + tl.minimum(c0 + tl.arange(0, COLS), n_cols - 1) // SCALE_COLS)
    return scales


@triton.jit
def fp8_slot_column_scales(
    s_ptrs, c0, n_cols, K: tl.constexpr, COLS: tl.constexpr, SCALE_COLS: tl.constexpr
):
    """[K, COLS]: `fp8_column_scales` for each of K block rows (s_ptrs [K])."""
    if SCALE_COLS % COLS == 0:
        scales = tl.load(s_ptrs + c0 // SCALE_COLS)[:, None] + tl.zeros([1, COLS], tl.float32)
    elif COLS % SCALE_COLS == 0 and (SCALE_COLS & (SCALE_COLS - 1)) == 0:
        blocks = tl.minimum(
            c0 // SCALE_COLS + tl.arange(0, COLS // SCALE_COLS), (n_cols - 1) // SCALE_COLS
        )
        per_block = tl.load(s_ptrs[:, None] + blocks[None, :])
        scales = tl.reshape(
            tl.broadcast_to(per_block[:, :, None], [K, COLS // SCALE_COLS, SCALE_COLS]), [K, COLS]
        )
    else:
        cols = tl.minimum(c0 + tl.arange(0, COLS), n_cols - 1) // SCALE_COLS
        scales = tl.load(s_ptrs[:, None] + cols[None, :])
    return scales


@triton.jit
def fp8_values(stored):
    """FP8 e4m3 bytes (stored as uint8, so masked loads can fill zeros) -> fp32 values."""
    return stored.to(tl.float8e4nv, bitcast=True).to(tl.float32)


# tl.dot's smallest K: an FP8 block narrower than this gets a scale per weight instead.
MIN_DOT_K = 16


def k_step(block_k: int, w: KernelWeight) -> int:
    """A K step that never straddles two scales where the kernels need one scale per step: int4
    groups, FP8 blocks of MIN_DOT_K columns or more. Narrower FP8 blocks keep `block_k`, and
    their scales are then applied weight by weight (see `quantized_dot`)."""
    step = scale_tile(block_k, w.scale_cols)
    return block_k if w.format == FP8_BLOCKS and step < MIN_DOT_K else step


def scale_weights(w: KernelWeight, asked: bool | None) -> bool:
    """`quantized_dot`'s SCALE_WEIGHTS for a tile that asked for it (True, False) or left it to
    the format (None): int4 scales its values, FP8 its partial products."""
    return w.format == INT4_GROUPS if asked is None else asked


@triton.jit
def quantized_dot(
    a,
    w,
    s_rows,
    k0,
    k_in,
    acc,
    FORMAT: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_WEIGHTS: tl.constexpr,
):
    """acc + a [M, BLOCK_K] @ W^T for a loaded quantized tile w [N, stored items] of the K step
    at k0; s_rows [N] points at each output row's scales. The dot's operands are in a's dtype.

    - a step within one scale (an int4 group, or an FP8 block): the dot on the raw values
      (exact in bf16), then each output column's scale on the partial product, which needs a
      second accumulator; with SCALE_WEIGHTS the values times their scale instead, then the dot
      into acc (a GEMM tile of many rows: half the accumulator registers, one multiply a
      weight, and each weight rounded to a's dtype once scaled);
    - FP8, blocks narrower than a step: values times their own block's scale, then the dot.
    """
    if FORMAT == 2:
        scale = tl.load(s_rows + k0 // SCALE_COLS).to(tl.float32)
        if SCALE_WEIGHTS:
            values = (int4_values(w, BLOCK_K) * scale[:, None]).to(a.dtype)
            acc = tl.dot(a, tl.trans(values), acc)
        else:
            values = int4_values(w, BLOCK_K).to(a.dtype)
            part = tl.dot(a, tl.trans(values), tl.zeros(acc.shape, dtype=tl.float32))
            acc += part * scale[None, :]
    elif SCALE_COLS % BLOCK_K == 0 and SCALE_WEIGHTS:
        scale = tl.load(s_rows + k0 // SCALE_COLS)
        values = w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
        acc = tl.dot(a, tl.trans(values.to(a.dtype)), acc)
    elif SCALE_COLS % BLOCK_K == 0:
        scale = tl.load(s_rows + k0 // SCALE_COLS)
        values = w.to(tl.float8e4nv, bitcast=True).to(a.dtype)
        part = tl.dot(a, tl.trans(values), tl.zeros(acc.shape, dtype=tl.float32))
        acc += part * scale[None, :]
    else:
        cols = tl.minimum(k0 + tl.arange(0, BLOCK_K), k_in - 1) // SCALE_COLS
        scale = tl.load(s_rows[:, None] + cols[None, :])
        values = w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
        acc = tl.dot(a, tl.trans(values.to(a.dtype)), acc)
    return acc
