"""Bookkeeping for the paged KV pool: reference counts, the prefix index, LRU eviction.

Pure Python, no tensors: the storage lives in `engine.kv_pool`. A block is in exactly one of
three states:
- referenced: ref count > 0 (in use by one or more sequences; never evicted),
- cached: ref count 0 but registered in the prefix index under its chain hash (evictable, LRU),
- free: ref count 0 and unregistered.
Only full blocks are registered; their hash chains the parent's hash, the block's tokens and a
per-model salt, so equal hashes mean equal token prefixes for the same model.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


class PoolExhausted(RuntimeError):
    """Not enough free or evictable blocks for an allocation."""


@dataclass
class AllocatorStats:
    blocks_total: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    blocks_evictable: int = 0
    evictions: int = 0
    hit_tokens: int = 0
    lookup_tokens: int = 0


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, salt: str = ""):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.salt = salt.encode()
        self.refs = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.hash_of: dict[int, bytes] = {}  # registered block -> chain hash
        self.block_of: dict[bytes, int] = {}  # chain hash -> registered block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recent first
        self.evictions = 0
        self.hit_tokens = 0
        self.lookup_tokens = 0

    # -- hashing -------------------------------------------------------------------------------
    def chain_hashes(self, tokens: list[int]) -> list[bytes]:
        """Hash of every full block of `tokens`, each chained on the one before."""
        hashes, parent = [], self.salt
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            h = hashlib.blake2b(parent, digest_size=16)
            h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in tokens[start : start + size]))
            parent = h.digest()
            hashes.append(parent)
        return hashes

    # -- sharing -------------------------------------------------------------------------------
    def match_prefix(self, tokens: list[int], max_tokens: int | None = None) -> list[int]:
        """Acquire the cached blocks of the longest cached full-block prefix of `tokens`
        (at most `max_tokens` tokens' worth) and return them in order."""
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        blocks = []
        for h in self.chain_hashes(tokens[: limit - limit % self.block_size]):
            block = self.block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            self.acquire(block)
        self.lookup_tokens += len(tokens)
        self.hit_tokens += len(blocks) * self.block_size
        return blocks

    def acquire(self, block: int) -> None:
        if self.refs[block] == 0:
            if block in self.evictable:
                del self.evictable[block]
            elif block in self.hash_of:
                raise AssertionError(f"registered block {block} with no refs is not evictable")
            else:
                raise AssertionError(f"block {block} is free; allocate it instead")
        self.refs[block] += 1

    def register(self, blocks: list[int], tokens: list[int]) -> None:
        """Index the full blocks of a sequence (`blocks` is its block table, `tokens` the tokens
        whose K/V are in it). A block whose prefix is already indexed elsewhere stays private."""
        for block, h in zip(blocks, self.chain_hashes(tokens)):
            if block in self.hash_of:
                continue
            if h not in self.block_of:
                self.block_of[h] = block
                self.hash_of[block] = h

    # -- allocation ----------------------------------------------------------------------------
    def available(self) -> int:
        return len(self.free) + len(self.evictable)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (ref count 1), evicting least recently used cached blocks if needed.
        All or nothing: raises PoolExhausted without side effects."""
        if n > self.available():
            raise PoolExhausted(
                f"KV pool exhausted: need {n} blocks, {len(self.free)} free and {len(self.evictable)} "
                f"evictable of {self.num_blocks}"
            )
        out = []
        for _ in range(n):
            if not self.free:
                self._evict_one()
            block = self.free.pop()
            self.refs[block] = 1
            out.append(block)
        return out

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.refs[block] <= 0:
                raise AssertionError(f"double free of block {block}")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.hash_of:
                    self.evictable[block] = None  # most recently used at the end
                else:
                    self.free.append(block)

    def _evict_one(self) -> None:
        block, _ = self.evictable.popitem(last=False)
        del self.block_of[self.hash_of.pop(block)]
        self.free.append(block)
        self.evictions += 1

    def evict_all(self) -> int:
        n = len(self.evictable)
        while self.evictable:
            self._evict_one()
        return n

    def is_shared(self, block: int) -> bool:
        """A block others may read: written only after a copy (copy-on-write)."""
        return self.refs[block] > 1 or block in self.hash_of

    def stats(self) -> AllocatorStats:
        used = sum(1 for r in self.refs if r > 0)
        return AllocatorStats(
            blocks_total=self.num_blocks,
            blocks_used=used,
            blocks_free=len(self.free),
            blocks_evictable=len(self.evictable),
            evictions=self.evictions,
            hit_tokens=self.hit_tokens,
            lookup_tokens=self.lookup_tokens,
        )

    def check_invariants(self) -> None:
        """Every block in exactly one state; index maps consistent. For tests and debugging."""
        free = set(self.free)
        assert len(free) == len(self.free), "a block is on the free list twice"
        for block in range(self.num_blocks):
            states = [self.refs[block] > 0, block in self.evictable, block in free]
            assert sum(states) == 1, f"block {block} is in {sum(states)} states (refs={self.refs[block]})"
            assert self.refs[block] >= 0
            if block in self.evictable:
                assert block in self.hash_of
            if block in free:
                assert block not in self.hash_of
        for block, h in self.hash_of.items():
            assert self.block_of[h] == block
        assert len(self.block_of) == len(self.hash_of)
