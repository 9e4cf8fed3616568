from hypothesis import given
from hypothesis import strategies as st

from liteinfer.engine.model_runner import cache_slots


@given(
    block_size=st.sampled_from([1, 2, 16]),
    table=st.lists(st.integers(0, 1000), min_size=1, max_size=8, unique=True),
    data=st.data(),
)
def test_cache_slots_are_each_positions_block_and_offset(block_size, table, data):
    end = data.draw(st.integers(1, len(table) * block_size))
    start = data.draw(st.integers(0, end - 1))
    blocks, offsets = cache_slots(table, start, end, block_size)
    assert blocks == [table[pos // block_size] for pos in range(start, end)]
    assert offsets == [pos % block_size for pos in range(start, end)]
