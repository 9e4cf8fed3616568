from unittest.mock import patch

import torch
from hypothesis import given
from hypothesis import strategies as st

from liteinfer import SamplingParams
from liteinfer.engine import workers
from liteinfer.engine.model_runner import ModelRunner, cache_slots
from liteinfer.engine.scheduler import ScheduledBatch
from liteinfer.engine.sequence import Sequence


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


def sequence(num_prompt: int, num_output: int, num_computed: int, table: list[int]) -> Sequence:
    seq = Sequence("r", 0, list(range(100, 100 + num_prompt + num_output)), num_prompt, SamplingParams(), 16,
                   detokenizer=None)
    seq.num_computed_tokens, seq.block_table = num_computed, table
    return seq


def test_each_token_takes_the_path_of_what_it_is_whatever_the_steps_shape():
    """Generated tokens are decodes, laid first (several of one sequence computed again after a preemption, each at
    its own position); prompt tokens are spans, even one alone; a sequence samples from the row of its last token."""
    decoding = sequence(num_prompt=5, num_output=3, num_computed=7, table=[10, 11])
    recomputing = sequence(num_prompt=6, num_output=3, num_computed=0, table=[20, 21, 22])  # preempted
    chunk = sequence(num_prompt=9, num_output=0, num_computed=4, table=[30, 31, 32])  # a middle chunk: no sample
    last_prompt_token = sequence(num_prompt=5, num_output=0, num_computed=4, table=[40, 41])  # a fork's tail
    batch = ScheduledBatch()
    for seq, count in [(decoding, 1), (recomputing, 9), (chunk, 3), (last_prompt_token, 1)]:
        batch.add(seq, count)
    runner = ModelRunner(model=None, sampler=None, block_size=4, device=torch.device("cpu"))

    input_ids, meta, sampling, _ = runner._prepare(batch)

    assert meta.positions.tolist() == [7, 6, 7, 8, 0, 1, 2, 3, 4, 5, 4, 5, 6, 4]
    assert input_ids.tolist() == [100 + p for p in meta.positions.tolist()]
    assert meta.num_decodes == 4
    assert meta.decode_block_tables.tolist() == [[10, 11, 0], [20, 21, 22], [20, 21, 22], [20, 21, 22]]
    assert [(s.start, s.end, s.block_table, s.num_keys) for s in meta.prefills] == [
        (4, 10, [20, 21, 22], 6), (10, 13, [30, 31, 32], 7), (13, 14, [40, 41], 5)]
    assert meta.slot_blocks.tolist() == [11, 21, 21, 22, 20, 20, 20, 20, 21, 21, 31, 31, 31, 41]
    assert meta.slot_offsets.tolist() == [3, 2, 3, 0, 0, 1, 2, 3, 0, 1, 0, 1, 2, 0]
    assert sampling == [(0, 0, 0), (1, 3, 0), (3, 13, 0)]  # (batch position, row, drafts before it), in row order


def test_a_sequences_drafts_follow_its_last_token_as_decodes_each_row_sampling():
    """Speculative decoding: the last token and its drafts are decodes at their own positions, in its blocks, and each
    of these rows samples, with the drafts before it as its output so far."""
    drafting = sequence(num_prompt=5, num_output=2, num_computed=6, table=[10, 11, 12])
    drafting.spec_token_ids = [7, 8, 9]
    plain = sequence(num_prompt=4, num_output=1, num_computed=4, table=[20, 21])
    batch = ScheduledBatch()
    batch.add(drafting, 4)
    batch.add(plain, 1)
    runner = ModelRunner(model=None, sampler=None, block_size=4, device=torch.device("cpu"))

    input_ids, meta, sampling, _ = runner._prepare(batch)

    assert meta.positions.tolist() == [6, 7, 8, 9, 4]
    assert input_ids.tolist() == [106, 7, 8, 9, 104]
    assert meta.num_decodes == 5 and not meta.prefills
    assert meta.decode_block_tables.tolist() == [[10, 11, 12]] * 4 + [[20, 21, 0]]
    assert meta.slot_blocks.tolist() == [11, 11, 12, 12, 21]
    assert meta.slot_offsets.tolist() == [2, 3, 0, 1, 0]
    assert sampling == [(0, 0, 0), (0, 1, 1), (0, 2, 2), (0, 3, 3), (1, 4, 0)]


@given(num_sampling=st.integers(0, 40), num_scored=st.integers(0, 40), at_once=st.integers(1, 16))
def test_head_groups_take_the_sampling_rows_together_then_the_scored_ones_a_few_at_a_time(
        num_sampling, num_scored, at_once):
    """Every rank cuts a step's head calls alike (each is a collective with tensor parallelism): never an empty call,
    the sampling rows in one, the scored rows in calls of at most `SCORED_ROWS_AT_ONCE`, all in order."""
    hidden = torch.arange(num_sampling + num_scored).float()[:, None]
    with patch.object(workers, "SCORED_ROWS_AT_ONCE", at_once):
        groups = workers.head_groups(hidden, num_sampling)
    assert all(len(group) for group in groups)
    assert torch.equal(torch.cat(groups) if groups else hidden, hidden)
    scored = groups[1:] if num_sampling else groups
    assert len(groups) - len(scored) == (num_sampling > 0) and all(len(group) <= at_once for group in scored)
    assert len(scored) == -(-num_scored // at_once)
