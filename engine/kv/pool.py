"""KV storage in fixed-size blocks, and the view that lets the model read and write it.

Storage per layer is one flat array of token slots, [num_blocks * block_size, Hkv, D]: slot
`block * block_size + offset`. Compacted: a sequence holds whole blocks and only its last one
is partly filled, so no slot is padding. Optional fp8 (e4m3) storage keeps one fp32 scale per
(slot, head) and is dequantised when attention reads it.
"""

from __future__ import annotations

import functools

import torch

from engine.kv.cache import LeanRows, ModelCache
from engine.kv.prefill_attention import (
    chunk_attention,
    flash_applies,
    is_one_run,
    masked_attention,
)
from kernels import reference as ref

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Prompt chunks on CUDA take flash attention: faster than the masked SDPA in engine.bench.decode's
# prefill stage (BENCHMARKS.md, "The tuned quantized tables in the step"), which checks the two
# against each other first.
FLASH_PREFILL = True


class KVPool:
    def __init__(
        self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, fp8=False
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype  # the dtype attention computes in
        self.fp8 = fp8
        # One block past the allocator's: where padding rows of a captured decode step write,
        # so they never touch a sequence's blocks.
        self.scratch_block = num_blocks
        slots = (num_blocks + 1) * block_size
        store = FP8 if fp8 else dtype
        # One tensor per kind for all layers (a block copy is one op), read per layer as views.
        # Zero-initialised: slots past a row's length are masked in attention but still meet V,
        # and 0 * NaN garbage would be NaN.
        self._stores = [
            torch.zeros(num_layers, slots, num_kv_heads, head_dim, dtype=store, device=device)
            for _ in range(2)
        ]
        if fp8:
            self._stores += [
                torch.ones(num_layers, slots, num_kv_heads, device=device) for _ in range(2)
            ]
        self.keys, self.values = list(self._stores[0]), list(self._stores[1])
        if fp8:
            self.key_scales, self.value_scales = list(self._stores[2]), list(self._stores[3])

    def bytes_per_token(self) -> int:
        """Bytes one cached token takes over all layers, K and V, scales included."""
        per_layer = sum(t[0].numel() * t.element_size() for t in (self.keys[0], self.values[0]))
        if self.fp8:
            per_layer += 2 * self.key_scales[0][0].numel() * 4
        return per_layer * len(self.keys)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, Hkv, D] into flat slots [N]."""
        if self.fp8:
            self._write_fp8(self.keys[layer], self.key_scales[layer], slots, k)
            self._write_fp8(self.values[layer], self.value_scales[layer], slots, v)
        else:
            self.keys[layer][slots] = k.to(self.dtype)
            self.values[layer][slots] = v.to(self.dtype)

    @staticmethod
    def _write_fp8(store, scales, slots, x):
        scale = x.float().abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
        store[slots] = (x.float() / scale[..., None]).to(FP8)
        scales[slots] = scale

    def read(self, layer: int, slots: torch.Tensor):
        """Keys and values at slots [B, S] -> [B, Hkv, S, D] each, in the compute dtype."""
        k, v = self.keys[layer][slots], self.values[layer][slots]
        if self.fp8:
            k = (k.float() * self.key_scales[layer][slots][..., None]).to(self.dtype)
            v = (v.float() * self.value_scales[layer][slots][..., None]).to(self.dtype)
        return k.transpose(1, 2), v.transpose(1, 2)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write of a shared partial block."""
        bs = self.block_size
        s, d = slice(src * bs, (src + 1) * bs), slice(dst * bs, (dst + 1) * bs)
        for store in self._stores:  # every layer at once
            store[:, d] = store[:, s]


class PagedBatch(ModelCache):
    """The model's cache argument for one forward over several sequences' block tables.

    The contiguous `KVCache`'s contract (`engine.kv.cache.ModelCache`): `attend` stores this step's
    K/V at the tokens' positions, then runs causal attention over every key each row may see.
    """

    def __init__(
        self,
        pool: KVPool,
        block_tables: list[list[int]],
        device,
        flash_prefill: bool | None = None,
    ):
        self.pool = pool
        self.block_tables = block_tables
        self.device = device
        self.kv_len = 0
        # CUDA prompt chunks' attention: flash attention where it applies, or always the masked
        # SDPA (engine.kv.prefill_attention); None: FLASH_PREFILL.
        self.flash_prefill = FLASH_PREFILL if flash_prefill is None else flash_prefill
        # Built at the first layer and shared by the rest: every layer sees the same positions.
        self._tables_i32 = self._lengths = self._row_runs = None
        self.chunk_flash: bool | None = None  # whether prompt chunks took flash attention

    # Built on first use: a lean CPU forward (`lean_rows`) needs neither.
    @functools.cached_property
    def tables(self) -> torch.Tensor:  # [B, blocks]
        width = max(len(t) for t in self.block_tables)
        padded = [t + [t[-1]] * (width - len(t)) for t in self.block_tables]
        return torch.tensor(padded, dtype=torch.long, device=self.device)

    @functools.cached_property
    def slot_map(self) -> torch.Tensor:  # [B, blocks * block_size]
        bs = self.pool.block_size
        offsets = torch.arange(bs, device=self.device)
        return (self.tables[:, :, None] * bs + offsets).reshape(len(self.block_tables), -1)

    def reserve(self, length: int) -> None:
        covered = max(len(t) for t in self.block_tables) * self.pool.block_size
        if length > covered:
            raise AssertionError(f"block table covers {covered} tokens, forward needs {length}")
        self.kv_len = length

    def lean_rows(self, position: int, count: int) -> LeanRows | None:
        """`ModelCache.lean_rows` for one CPU sequence (e.g. a decode step's token, or a
        speculative draft's verification): its rows' flat slots and the slot runs of positions
        0..position+count-1. None where the general path must run (several sequences, fp8
        storage, a GPU pool)."""
        if not self._lean_applies():
            return None
        table, bs = self.block_tables[0], self.pool.block_size
        self.reserve(position + count)
        slots = [table[p // bs] * bs + p % bs for p in range(position, position + count)]
        return LeanRows(slots, slot_runs(table, bs, position + count))

    def _lean_applies(self) -> bool:
        pool = self.pool
        return len(self.block_tables) == 1 and not pool.fp8 and pool.keys[0].device.type == "cpu"

    def layer_stores(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's flat key and value stores, [slots, Hkv, D] each."""
        return self.pool.keys[layer], self.pool.values[layer]

    def attend(self, layer, positions, q, k, v, sliding_window=None):
        """Store this step's K/V in the pool, then causal attention of q [B, Hq, T, D].

        Decode steps on CUDA read the blocks in place (Triton paged attention), so does the CPU
        (runs of consecutive slots as views; a prefill chunk joins them for the fused attention);
        fp8 storage elsewhere gathers and dequantises."""
        pool = self.pool
        slots = self.slot_map.gather(1, positions)  # [B, T]
        pool.write(layer, slots.reshape(-1), _rows(k), _rows(v))
        if q.is_cuda and q.shape[2] == 1 and sliding_window is None and _pow2(pool.block_size):
            from kernels.paged_attention import paged_decode_attention

            if self._tables_i32 is None:
                self._tables_i32 = self.tables.to(torch.int32)
                self._lengths = (positions[:, 0] + 1).to(torch.int32)
            scales = (
                (pool.key_scales[layer], pool.value_scales[layer]) if pool.fp8 else (None, None)
            )
            out = paged_decode_attention(
                q[:, :, 0],
                pool.keys[layer],
                pool.values[layer],
                self._tables_i32,
                self._lengths,
                pool.block_size,
                *scales,
            )
            return out[:, :, None]
        if not pool.fp8 and not q.is_cuda:
            if self._row_runs is None:
                self._row_runs = [
                    slot_runs(table, pool.block_size, int(positions[row].max()) + 1)
                    for row, table in enumerate(self.block_tables)
                ]
            keys, values = pool.keys[layer], pool.values[layer]
            return torch.stack(
                [
                    ref.attention_over_runs(
                        q[row],
                        [keys[a:b] for a, b in runs],
                        [values[a:b] for a, b in runs],
                        positions[row],
                        sliding_window,
                    )
                    for row, runs in enumerate(self._row_runs)
                ]
            )
        keys, values = pool.read(layer, self.slot_map[:, : self.kv_len])
        if q.is_cuda:  # prefill: a fused attention kernel instead of materialised scores
            if self.chunk_flash is None:
                self.chunk_flash = (
                    self.flash_prefill
                    and sliding_window is None
                    and is_one_run(positions, self.kv_len)
                    and flash_applies(q, keys, values)
                )
            if self.chunk_flash:
                return chunk_attention(q, keys, values)
            return masked_attention(q, keys, values, positions, sliding_window)
        return ref.attention(q, keys, values, positions, sliding_window=sliding_window)


def slot_runs(table: list[int], block_size: int, length: int) -> list[tuple[int, int]]:
    """[start, end) slot ranges holding positions 0..length-1 of a sequence, consecutive blocks
    merged: a compacted sequence is one run."""
    blocks = table[: -(-length // block_size)]
    runs: list[list[int]] = []
    for block in blocks:
        if runs and runs[-1][1] == block * block_size:
            runs[-1][1] += block_size
        else:
            runs.append([block * block_size, (block + 1) * block_size])
    runs[-1][1] -= len(blocks) * block_size - length  # the last block may be partly filled
    return [(a, b) for a, b in runs]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B*T, Hkv, D]"""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
