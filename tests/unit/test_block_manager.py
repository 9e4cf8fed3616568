from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from liteinfer.cache import BlockManager

BLOCK_SIZE = 4


@pytest.fixture
def manager() -> BlockManager:
    return BlockManager(num_blocks=8, block_size=BLOCK_SIZE)


def test_block_manager_new_pool_all_blocks_free(manager):
    assert manager.num_free_blocks == 8
    assert sorted(manager.free_blocks) == list(range(8))
    assert manager.ref_counts == [0] * 8
    assert manager.usage == 0.0


@pytest.mark.parametrize(("num_tokens", "blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_block_manager_blocks_for_rounds_up(manager, num_tokens, blocks):
    assert manager.blocks_for(num_tokens) == blocks


def test_block_manager_allocate_takes_distinct_blocks_with_ref_one(manager):
    table: list[int] = []
    assert manager.allocate(table, 10)  # 3 blocks of 4
    assert len(table) == 3 and len(set(table)) == 3
    assert all(manager.ref_counts[b] == 1 for b in table)
    assert not set(table) & set(manager.free_blocks)
    assert manager.num_free_blocks == 5
    assert manager.usage == pytest.approx(3 / 8)


def test_block_manager_allocate_grows_table_only_by_missing_blocks(manager):
    table: list[int] = []
    manager.allocate(table, 3)
    first = list(table)
    assert manager.allocate(table, 4)  # still fits in the first block
    assert table == first
    assert manager.allocate(table, 5)  # needs a second block; the first stays in place
    assert table[:1] == first and len(table) == 2
    assert manager.num_free_blocks == 6


def test_block_manager_allocate_short_returns_false_and_leaves_table_untouched(manager):
    held: list[int] = []
    manager.allocate(held, 6 * BLOCK_SIZE)
    table: list[int] = []
    manager.allocate(table, 1)
    before_table, before_refs, before_free = list(table), list(manager.ref_counts), list(manager.free_blocks)

    assert not manager.allocate(table, 4 * BLOCK_SIZE)  # needs 3 more, only 1 free

    assert table == before_table
    assert manager.ref_counts == before_refs
    assert list(manager.free_blocks) == before_free


def test_block_manager_allocate_exactly_the_free_blocks_succeeds(manager):
    table: list[int] = []
    assert manager.allocate(table, 8 * BLOCK_SIZE)
    assert manager.num_free_blocks == 0
    assert not manager.allocate([], 1)


def test_block_manager_free_returns_blocks_and_empties_table(manager):
    table: list[int] = []
    manager.allocate(table, 3 * BLOCK_SIZE)
    blocks = list(table)
    manager.free(table)
    assert table == []
    assert manager.num_free_blocks == 8
    assert all(manager.ref_counts[b] == 0 for b in blocks)
    assert sorted(manager.free_blocks) == list(range(8))


def test_block_manager_share_adds_reference_and_block_survives_one_free(manager):
    parent: list[int] = []
    manager.allocate(parent, 2 * BLOCK_SIZE)
    child = manager.share(parent)
    assert child == parent and child is not parent
    assert all(manager.ref_counts[b] == 2 for b in parent)
    assert manager.num_free_blocks == 6  # sharing takes no new blocks

    shared = list(parent)
    manager.free(parent)
    assert all(manager.ref_counts[b] == 1 for b in shared)
    assert manager.num_free_blocks == 6  # still held by the child
    assert not set(shared) & set(manager.free_blocks)

    manager.free(child)
    assert manager.num_free_blocks == 8
    assert all(manager.ref_counts[b] == 0 for b in shared)


def test_block_manager_shared_prefix_then_grow_takes_private_blocks(manager):
    parent: list[int] = []
    manager.allocate(parent, 2 * BLOCK_SIZE + 1)  # 3 blocks; share only the 2 full ones
    child = manager.share(parent[:2])
    assert manager.allocate(child, 3 * BLOCK_SIZE)
    assert child[:2] == parent[:2] and child[2] != parent[2]
    assert [manager.ref_counts[b] for b in child] == [2, 2, 1]
    assert manager.num_free_blocks == 4


def test_block_manager_share_free_block_raises(manager):
    with pytest.raises(RuntimeError, match="free"):
        manager.share([3])
    assert manager.ref_counts[3] == 0


def test_block_manager_double_free_raises(manager):
    table: list[int] = []
    manager.allocate(table, 2 * BLOCK_SIZE)
    stale_copy = list(table)
    manager.free(table)
    with pytest.raises(RuntimeError, match="double free"):
        manager.free(stale_copy)
    assert manager.num_free_blocks == 8
    assert sorted(manager.free_blocks) == list(range(8))  # nothing entered the free list twice


def test_block_manager_free_empty_table_is_noop(manager):
    manager.free([])
    assert manager.num_free_blocks == 8


NUM_BLOCKS = 6


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / grow / share / free over a small pool; the model is the set of live block tables."""

    tables = Bundle("tables")

    def __init__(self):
        super().__init__()
        self.manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.live: dict[int, list[int]] = {}  # key -> the table object handed to the manager
        self.next_key = 0

    def _track(self, table: list[int]) -> int:
        key = self.next_key
        self.next_key += 1
        self.live[key] = table
        return key

    def _capacity(self, table: list[int]) -> int:
        return len(table) * BLOCK_SIZE

    @rule(target=tables, num_tokens=st.integers(1, (NUM_BLOCKS + 2) * BLOCK_SIZE))
    def allocate(self, num_tokens):
        table: list[int] = []
        free_before = self.manager.num_free_blocks
        ok = self.manager.allocate(table, num_tokens)
        needed = self.manager.blocks_for(num_tokens)
        assert ok == (needed <= free_before)
        if ok:
            assert len(table) == needed
        else:
            assert table == [] and self.manager.num_free_blocks == free_before
        return self._track(table)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra_tokens=st.integers(0, 3 * BLOCK_SIZE))
    def grow(self, data, extra_tokens):
        key = data.draw(st.sampled_from(sorted(self.live)))
        table = self.live[key]
        before = list(table)
        free_before = self.manager.num_free_blocks
        num_tokens = self._capacity(table) + extra_tokens
        needed = self.manager.blocks_for(num_tokens) - len(table)
        ok = self.manager.allocate(table, num_tokens)
        assert ok == (needed <= free_before)
        if ok:
            assert table[: len(before)] == before and len(table) == len(before) + needed
        else:
            assert table == before and self.manager.num_free_blocks == free_before

    @precondition(lambda self: any(self.live.values()))
    @rule(target=tables, data=st.data())
    def share(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, t in self.live.items() if t)))
        parent = self.live[key]
        prefix_len = data.draw(st.integers(1, len(parent)))
        child = self.manager.share(parent[:prefix_len])
        assert child == parent[:prefix_len]
        return self._track(child)

    @rule(key=consumes(tables))
    def free(self, key):
        table = self.live.pop(key)
        self.manager.free(table)
        assert table == []

    @invariant()
    def every_block_is_free_or_held_by_its_tables(self):
        manager = self.manager
        holders = Counter(b for table in self.live.values() for b in table)
        free_list = Counter(list(manager.free_blocks))
        for block in range(NUM_BLOCKS):
            if holders[block] == 0:
                assert manager.ref_counts[block] == 0
                assert free_list[block] == 1, f"block {block} leaked or listed twice"
            else:
                assert manager.ref_counts[block] == holders[block]
                assert free_list[block] == 0, f"block {block} is held but in the free list"
        assert set(free_list) <= set(range(NUM_BLOCKS))
        assert manager.num_free_blocks + len(holders) == NUM_BLOCKS

    @invariant()
    def no_table_holds_a_block_twice(self):
        for table in self.live.values():
            assert len(table) == len(set(table))

    def teardown(self):
        for table in self.live.values():
            self.manager.free(table)
        assert self.manager.num_free_blocks == NUM_BLOCKS
        assert self.manager.ref_counts == [0] * NUM_BLOCKS


BlockManagerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
test_block_manager_random_operations_keep_ref_counts_consistent = BlockManagerMachine.TestCase
