"""A plain contiguous KV cache: one [B, S, Hkv, D] buffer per layer for K and for V.

Tokens are written at their absolute positions, so rows of a batch may have different lengths;
causal masking by position keeps stale slots past a row's length out of its attention.
"""

from __future__ import annotations

import torch

from engine.kv.cache import LeanRows, ModelCache
from kernels import reference as ref


class KVCache(ModelCache):
    def __init__(self, num_layers, batch, num_kv_heads, head_dim, capacity, dtype, device):
        self.shape = (batch, capacity, num_kv_heads, head_dim)
        # Zeros, not empty: masked slots still meet V in probs @ V, and 0 * NaN garbage is NaN.
        self.keys = [torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [
            torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        self.used = 0  # one past the highest position written so far, over all rows

    @property
    def capacity(self) -> int:
        return self.shape[1]

    def reserve(self, length: int) -> None:
        """Grow (doubling) so that positions < length fit."""
        if length <= self.capacity:
            return
        new_capacity = max(length, 2 * self.capacity)
        batch, old, heads, dim = self.shape
        self.shape = (batch, new_capacity, heads, dim)
        for buffers in (self.keys, self.values):
            for i, old_buf in enumerate(buffers):
                grown = torch.zeros(self.shape, dtype=old_buf.dtype, device=old_buf.device)
                grown[:, :old] = old_buf
                buffers[i] = grown

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, Hkv, T, D] at positions [B, T]; return this layer's keys and values
        [B, Hkv, S, D] for S = every position written so far."""
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        self.keys[layer][rows, positions] = k.transpose(1, 2)
        self.values[layer][rows, positions] = v.transpose(1, 2)
        self.used = max(self.used, int(positions.max()) + 1)
        return (
            self.keys[layer][:, : self.used].transpose(1, 2),
            self.values[layer][:, : self.used].transpose(1, 2),
        )

    def lean_rows(self, position: int, count: int) -> LeanRows | None:
        """`ModelCache.lean_rows`: the one row's slots are its positions, and positions
        0..position+count-1 are one run. None past a gap of unwritten slots."""
        if self.shape[0] != 1 or self.keys[0].device.type != "cpu" or position > self.used:
            return None
        self.reserve(position + count)
        self.used = max(self.used, position + count)
        return LeanRows(list(range(position, position + count)), [(0, position + count)])

    def layer_stores(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's key and value buffers of the one row, [capacity, Hkv, D] each."""
        return self.keys[layer][0], self.values[layer][0]

    def attend(self, layer, positions, q, k, v, sliding_window=None):
        """Store this step's K/V, then causal attention of q [B, Hq, T, D] over the cache."""
        keys, values = self.write(layer, positions, k, v)
        return ref.attention(q, keys, values, positions, sliding_window=sliding_window)
