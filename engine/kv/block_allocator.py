"""Bookkeeping for the paged KV pool: reference counts, the prefix index, LRU eviction.

Pure Python, no tensors: the storage lives in `engine.kv.pool`. A block is in exactly one of
three states:
- referenced: ref count > 0 (in use by one or more sequences; never evicted),
- cached: ref count 0 but registered in the prefix index under its chain hash (evictable, LRU),
- free: ref count 0 and unregistered.
Full blocks are registered under a hash that chains the parent's hash, the block's tokens and a
per-model salt, so equal hashes mean equal token prefixes for the same model. A finished
sequence's last, partly filled block is registered too. Past the last whole-block match, a
prompt may reuse the first tokens of any registered child of the matched prefix (the sharer
copies that block before writing): the next keystroke's prompt usually extends the last one,
so one or two tokens are left to compute instead of up to a block.
"""

from __future__ import annotations

import array
import hashlib
import sys
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
        # Every registered block under its parent's chain hash, with the tokens it holds.
        self.children: dict[bytes, dict[int, tuple[int, ...]]] = {}
        self.parent_of: dict[int, bytes] = {}

    # -- hashing -------------------------------------------------------------------------------
    def chain_hashes(self, tokens: list[int], known: list[bytes] | None = None) -> list[bytes]:
        """Hash of every full block of `tokens`, each chained on the one before.

        `known`: the hashes of a sequence whose tokens only grow (a request's prompt, then what
        it generates), of which `tokens` is a prefix: the hashes it lacks are appended to it, so
        each block is hashed once however often the sequence is looked up or registered."""
        size = self.block_size
        hashes = [] if known is None else known
        full = len(tokens) // size
        if len(hashes) < full:
            parent = hashes[-1] if hashes else self.salt
            first = len(hashes) * size
            # 4 bytes a token, packed once: this runs on every request
            data = _token_bytes(tokens[first : full * size])
            for start in range(0, len(data), 4 * size):
                h = hashlib.blake2b(parent, digest_size=16)
                h.update(data[start : start + 4 * size])
                parent = h.digest()
                hashes.append(parent)
        return hashes[:full]

    # -- sharing -------------------------------------------------------------------------------
    def match_prefix(self, tokens: list[int], max_tokens: int | None = None) -> list[int]:
        """Acquire the cached blocks of the longest cached full-block prefix of `tokens`
        (at most `max_tokens` tokens' worth) and return them in order."""
        blocks, _ = self.match_prefix_partial(tokens, max_tokens, partial=False)
        return blocks

    def match_prefix_partial(
        self,
        tokens: list[int],
        max_tokens: int | None = None,
        partial: bool = True,
        known: list[bytes] | None = None,
    ) -> tuple[list[int], int]:
        """Like `match_prefix`, then also the cached block that continues that prefix longest.
        `known`: the sequence's hashes so far (`chain_hashes`).

        Returns (blocks, cached tokens). When the last block is a partial match, only its first
        `cached - block_size * (len(blocks) - 1)` tokens are valid: copy it before writing."""
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        size = self.block_size
        blocks, parent = [], self.salt
        for h in self.chain_hashes(tokens[: limit - limit % size], known):
            block = self.block_of.get(h)
            if block is None:
                break
            blocks.append(block)
            parent = h
        cached = len(blocks) * size
        if partial and limit > cached:
            want = tokens[cached:limit]
            best, best_len = None, 0
            for block, held in self.children.get(parent, {}).items():
                common = _common_prefix(held, want)
                if common > best_len:
                    best, best_len = block, common
            if best is not None:
                blocks.append(best)
                cached += best_len
        for block in blocks:
            self.acquire(block)
        self.lookup_tokens += len(tokens)
        self.hit_tokens += cached
        return blocks, cached

    def acquire(self, block: int) -> None:
        if self.refs[block] == 0:
            if block in self.evictable:
                del self.evictable[block]
            elif block in self.hash_of:
                raise AssertionError(f"registered block {block} with no refs is not evictable")
            else:
                raise AssertionError(f"block {block} is free; allocate it instead")
        self.refs[block] += 1

    def register(
        self,
        blocks: list[int],
        tokens: list[int],
        partial: bool = False,
        known: list[bytes] | None = None,
    ) -> None:
        """Index the full blocks of a sequence (`blocks` is its block table, `tokens` the tokens
        whose K/V are in it; `known` its hashes so far, as for `chain_hashes`). A block whose
        prefix is already indexed elsewhere stays private. With `partial` (a sequence that is
        done writing), its partly filled last block too."""
        size = self.block_size
        hashes = self.chain_hashes(tokens, known)
        parents = [self.salt] + hashes
        for index, (block, h) in enumerate(zip(blocks, hashes)):
            if block not in self.hash_of and h not in self.block_of:
                self._index(block, h, parents[index], tokens[index * size : (index + 1) * size])
        tail = len(tokens) - len(hashes) * size
        if partial and tail and len(blocks) > len(hashes):
            held = tokens[len(hashes) * size :]
            parent = parents[len(hashes)]
            h = hashlib.blake2b(parent + b"partial" + _token_bytes(held), digest_size=16).digest()
            block = blocks[len(hashes)]
            if block not in self.hash_of and h not in self.block_of:
                self._index(block, h, parent, held)

    def _index(self, block: int, h: bytes, parent: bytes, held: list[int]) -> None:
        self.block_of[h] = block
        self.hash_of[block] = h
        self.children.setdefault(parent, {})[block] = tuple(held)
        self.parent_of[block] = parent

    # -- allocation ----------------------------------------------------------------------------
    def available(self) -> int:
        return len(self.free) + len(self.evictable)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (ref count 1), evicting least recently used cached blocks if needed.
        All or nothing: raises PoolExhausted without side effects."""
        if n > self.available():
            raise PoolExhausted(
                f"KV pool exhausted: need {n} blocks, {len(self.free)} free and "
                f"{len(self.evictable)} evictable of {self.num_blocks}"
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
        parent = self.parent_of.pop(block)
        del self.children[parent][block]
        if not self.children[parent]:
            del self.children[parent]
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
            assert sum(states) == 1, (
                f"block {block} is in {sum(states)} states (refs={self.refs[block]})"
            )
            assert self.refs[block] >= 0
            if block in self.evictable:
                assert block in self.hash_of
            if block in free:
                assert block not in self.hash_of
        for block, h in self.hash_of.items():
            assert self.block_of[h] == block
        assert len(self.block_of) == len(self.hash_of)
        for parent, siblings in self.children.items():
            assert siblings, "an empty child index"
            for block, held in siblings.items():
                assert self.parent_of[block] == parent and block in self.hash_of
                assert 0 < len(held) <= self.block_size
        assert (
            len(self.parent_of) == len(self.hash_of) == sum(len(s) for s in self.children.values())
        )


def _token_bytes(tokens) -> bytes:
    return (
        array.array("I", tokens).tobytes()
        if sys.byteorder == "little"
        else b"".join(t.to_bytes(4, "little") for t in tokens)
    )


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
