"""Property-based checks of the KV block bookkeeping: no leaks, no double frees, consistent
reference counts, capacity respected, whatever the order of operations."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv.block_allocator import BlockAllocator, PoolExhausted
from engine.kv.sequence import BlockTable

BLOCK = 4
POOL = 24
VOCAB = 3  # a tiny vocabulary makes shared prefixes common


class ShadowPool:
    """Stands in for the KV pool: which token each slot holds, so reuse can be checked."""

    def __init__(self):
        self.slots = [[None] * BLOCK for _ in range(POOL)]

    def copy_block(self, src, dst):
        self.slots[dst] = list(self.slots[src])

    def write(self, table, tokens, start, end):
        for p in range(start, end):
            self.slots[table.blocks[p // BLOCK]][p % BLOCK] = tokens[p]

    def holds(self, table, tokens, end):
        return all(self.slots[table.blocks[p // BLOCK]][p % BLOCK] == tokens[p] for p in range(end))


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(POOL, BLOCK, salt="test")
        self.pool = ShadowPool()
        self.seqs: list[tuple[BlockTable, list[int]]] = []

    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
    def allocate(self, tokens):
        shared, cached = self.alloc.match_prefix_partial(tokens, max_tokens=len(tokens) - 1)
        table = BlockTable(self.alloc, self.pool, shared)
        assert self.pool.holds(table, tokens, cached)  # a hit holds exactly the prompt's tokens
        try:
            table.prepare_write(cached, len(tokens))  # copies a partly reused block first
        except PoolExhausted:
            table.free()
            return
        assert self.pool.holds(table, tokens, cached)
        self.pool.write(table, tokens, cached, len(tokens))
        self.alloc.register(table.blocks, tokens)
        self.seqs.append((table, tokens))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9))
    def append(self, data, extra):
        i = data.draw(st.integers(0, len(self.seqs) - 1))
        table, tokens = self.seqs[i]
        try:
            table.prepare_write(len(tokens), len(tokens) + len(extra))
        except PoolExhausted:
            return
        self.pool.write(table, tokens + extra, len(tokens), len(tokens) + len(extra))
        tokens = tokens + extra
        self.alloc.register(table.blocks, tokens)
        self.seqs[i] = (table, tokens)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        """A sequence done writing: its partly filled last block becomes reusable too."""
        table, tokens = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        self.alloc.register(table.blocks, tokens, partial=True)
        table.free()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        table, tokens = self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))]
        self.seqs.append((table.fork(), list(tokens)))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        table, _ = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        table.free()

    @rule()
    def evict_all(self):
        self.alloc.evict_all()

    @invariant()
    def consistent(self):
        self.alloc.check_invariants()
        expected = [0] * POOL
        for table, tokens in self.seqs:
            assert table.capacity >= len(tokens)
            for block in table.blocks:
                expected[block] += 1
        assert expected == self.alloc.refs  # every reference is held by exactly one table slot
        assert sum(1 for r in self.alloc.refs if r) + self.alloc.available() == POOL

    def teardown(self):
        for table, _ in self.seqs:
            table.free()
        self.alloc.check_invariants()
        assert all(r == 0 for r in self.alloc.refs)
        assert self.alloc.available() == POOL


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_shared_prefix_blocks_are_reused_and_exhaustion_is_all_or_nothing():
    alloc = BlockAllocator(4, 2)
    a = alloc.allocate(3)
    alloc.register(a, [1, 2, 3, 4, 5, 6])
    alloc.release(a)
    assert alloc.match_prefix([1, 2, 3, 4, 9]) == a[:2]
    before = (list(alloc.refs), list(alloc.free), dict(alloc.evictable))
    with pytest.raises(PoolExhausted, match="need 3 blocks"):
        alloc.allocate(3)
    assert before == (list(alloc.refs), list(alloc.free), dict(alloc.evictable))
    with pytest.raises(AssertionError, match="double free"):
        alloc.release([a[2], a[2]])
