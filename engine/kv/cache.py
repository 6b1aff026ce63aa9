"""The KV cache as the model sees it: the contiguous `KVCache` and the paged `PagedBatch` both
implement `ModelCache`, so the model needs no other knowledge of how its keys are stored."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class LeanRows(NamedTuple):
    """Where a lean CPU forward of one sequence's new rows writes and reads (engine.model.lean_cpu).

    `slots`: the flat store slots the rows' K/V go to, one a row. `runs`: [start, end) slot ranges
    that hold positions 0..position+count-1 in order, consecutive slots merged."""

    slots: list[int]
    runs: list[tuple[int, int]]


class ModelCache(Protocol):
    """What a forward asks of its cache argument.

    The caches subclass it explicitly, so each method raises: one a cache forgets to implement
    fails loudly instead of inheriting a silent `None`."""

    def reserve(self, length: int) -> None:
        """Make room for positions below `length`, or fail where the cache cannot hold them."""
        raise NotImplementedError

    def attend(
        self,
        layer: int,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Store k, v [B, Hkv, T, D] at positions [B, T], then causal attention of q
        [B, Hq, T, D] over every key each row may see: [B, Hq, T, D]."""
        raise NotImplementedError

    def lean_rows(self, position: int, count: int) -> LeanRows | None:
        """For the lean CPU forward: `count` new tokens of one sequence at positions position..
        (0: only the runs of positions 0..position-1). None where this cache cannot serve that
        forward (several sequences, fp8 storage, a GPU, a gap of unwritten positions): the
        general path then runs."""
        raise NotImplementedError

    def layer_stores(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's flat key and value stores [slots, Hkv, D], the ones `lean_rows` indexes."""
        raise NotImplementedError
