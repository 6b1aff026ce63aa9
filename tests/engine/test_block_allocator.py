"""Property-based checks of the KV block bookkeeping: no leaks, no double frees, consistent
reference counts, capacity respected, whatever the order of operations."""

import pytest
from hypothesis import given, settings
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
        # Each sequence's table, tokens and chain hashes so far (extended as its tokens grow).
        self.seqs: list[tuple[BlockTable, list[int], list[bytes]]] = []

    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
    def allocate(self, tokens):
        known = []
        shared, cached = self.alloc.match_prefix_partial(
            tokens, max_tokens=len(tokens) - 1, known=known
        )
        table = BlockTable(self.alloc, self.pool, shared)
        assert self.pool.holds(table, tokens, cached)  # a hit holds exactly the prompt's tokens
        try:
            table.prepare_write(cached, len(tokens))  # copies a partly reused block first
        except PoolExhausted:
            table.free()
            return
        assert self.pool.holds(table, tokens, cached)
        self.pool.write(table, tokens, cached, len(tokens))
        self.alloc.register(table.blocks, tokens, known=known)
        assert known == self.alloc.chain_hashes(tokens)
        self.seqs.append((table, tokens, known))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9))
    def append(self, data, extra):
        i = data.draw(st.integers(0, len(self.seqs) - 1))
        table, tokens, known = self.seqs[i]
        try:
            table.prepare_write(len(tokens), len(tokens) + len(extra))
        except PoolExhausted:
            return
        self.pool.write(table, tokens + extra, len(tokens), len(tokens) + len(extra))
        tokens = tokens + extra
        self.alloc.register(table.blocks, tokens, known=known)
        self.seqs[i] = (table, tokens, known)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        """A sequence done writing: its partly filled last block becomes reusable too."""
        table, tokens, known = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        self.alloc.register(table.blocks, tokens, partial=True, known=known)
        table.free()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        table, tokens, known = self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))]
        self.seqs.append((table.fork(), list(tokens), list(known)))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        table, _, _ = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        table.free()

    @rule()
    def evict_all(self):
        self.alloc.evict_all()

    @invariant()
    def consistent(self):
        self.alloc.check_invariants()
        expected = [0] * POOL
        for table, tokens, known in self.seqs:
            assert table.capacity >= len(tokens)
            assert known == self.alloc.chain_hashes(tokens)
            for block in table.blocks:
                expected[block] += 1
        assert expected == self.alloc.refs  # every reference is held by exactly one table slot
        assert sum(1 for r in self.alloc.refs if r) + self.alloc.available() == POOL

    def teardown(self):
        for table, _, _ in self.seqs:
            table.free()
        self.alloc.check_invariants()
        assert all(r == 0 for r in self.alloc.refs)
        assert self.alloc.available() == POOL


TestPoolMachine = PoolMachine.TestCase


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=60),
    st.lists(st.integers(0, 60), max_size=6),
)
def test_known_hashes_grow_into_the_same_chain(tokens, cuts):
    """Hashes extended prefix by prefix, in any order of lengths, are the chain of the whole."""
    alloc = BlockAllocator(8, BLOCK, salt="s")
    known = []
    for cut in [*cuts, len(tokens)]:
        assert alloc.chain_hashes(tokens[:cut], known) == alloc.chain_hashes(tokens[:cut])
    assert known == alloc.chain_hashes(tokens)


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
