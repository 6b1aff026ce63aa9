"""A sequence's block table: which pool blocks hold its tokens' K/V, with copy-on-write."""

from __future__ import annotations

from engine.kv.block_allocator import BlockAllocator
from engine.kv.pool import KVPool


class BlockTable:
    def __init__(
        self, allocator: BlockAllocator, pool: KVPool | None, blocks: list[int] | None = None
    ):
        self.allocator = allocator
        self.pool = pool  # None in bookkeeping-only tests
        self.blocks: list[int] = list(blocks or ())

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.allocator.block_size

    def grow_to(self, num_tokens: int) -> None:
        """Allocate blocks so that `num_tokens` tokens fit (all or nothing)."""
        size = self.allocator.block_size
        missing = -(-num_tokens // size) - len(self.blocks)
        if missing > 0:
            self.blocks += self.allocator.allocate(missing)

    def prepare_write(self, start: int, end: int) -> None:
        """Make the blocks covering token positions [start, end) private to this sequence,
        copying any block another sequence or the prefix index still shares."""
        self.grow_to(end)
        size = self.allocator.block_size
        for index in range(start // size, -(-end // size)):
            block = self.blocks[index]
            if self.allocator.is_shared(block):
                (fresh,) = self.allocator.allocate(1)
                if self.pool is not None:
                    self.pool.copy_block(block, fresh)
                self.allocator.release([block])
                self.blocks[index] = fresh

    def fork(self) -> BlockTable:
        """A second table sharing every block; whichever writes first into a shared block copies
        it."""
        for block in self.blocks:
            self.allocator.acquire(block)
        return BlockTable(self.allocator, self.pool, list(self.blocks))

    def free(self) -> None:
        blocks, self.blocks = self.blocks, []
        self.allocator.release(blocks)
