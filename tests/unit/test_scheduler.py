import itertools
from collections import Counter

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from liteinfer.cache import BlockManager
from liteinfer.engine.scheduler import ScheduledBatch, Scheduler, StaticScheduler
from liteinfer.engine.sequence import Sequence, SequenceStatus
from liteinfer.sampling import SamplingParams

BLOCK_SIZE = 4
PARAMS = SamplingParams()
_ids = itertools.count()


def make_seq(prompt_len: int, max_tokens: int = 8) -> Sequence:
    """A real Sequence; the scheduler never touches its detokenizer, so none is attached."""
    return Sequence(
        request_id=f"req-{next(_ids)}",
        index=0,
        token_ids=[7] * prompt_len,
        num_prompt_tokens=prompt_len,
        params=PARAMS,
        max_tokens=max_tokens,
        detokenizer=None,
    )


def make_scheduler(
    num_blocks=16, max_num_seqs=8, max_num_batched_tokens=64, cls=Scheduler, prefix_caching=False, chunked=False
) -> Scheduler:
    manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    if cls is StaticScheduler:
        return cls(manager, max_num_seqs, max_num_batched_tokens)
    return cls(manager, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill=chunked)


def start_forks(scheduler: Scheduler, parent: Sequence, samples: list[Sequence]) -> None:
    """What the engine does once the first sample of a request of n has computed its prompt (`LLMEngine._fork`): the
    others wait at the front of the queue holding its prompt's full blocks, but for the block of its last token."""
    shared_blocks = (parent.num_prompt_tokens - 1) // BLOCK_SIZE
    for sample in reversed(samples):
        sample.block_table = scheduler.block_manager.share(parent.block_table[:shared_blocks])
        sample.num_computed_tokens = shared_blocks * BLOCK_SIZE
        scheduler.add(sample, front=True)


def run_batch(scheduler: Scheduler, batch: ScheduledBatch,
              forks: dict[Sequence, list[Sequence]] | None = None) -> list[Sequence]:
    """Do what the engine does after a forward pass: count the computed tokens, sample one token for every
    sequence that reached its end (a first sample starting the others of its request, `forks`, after its first
    token), and finish those that hit max_tokens. Returns the finished ones."""
    finished = []
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
        start = seq.num_computed_tokens
        seq.num_computed_tokens += num_new
        scheduler.block_manager.cache_blocks(seq.block_table, seq.token_ids, seq.block_hashes, start, start + num_new)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(1)
            if forks and seq in forks:
                start_forks(scheduler, seq, forks.pop(seq))
            if seq.num_output_tokens >= seq.max_tokens:
                scheduler.finish(seq)
                finished.append(seq)
    return finished


def step(scheduler: Scheduler) -> ScheduledBatch:
    batch = scheduler.schedule()
    run_batch(scheduler, batch)
    return batch


# ----------------------------------------------------------------------------------------------------------
# Continuous batching


def test_scheduler_admission_respects_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(3) for _ in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.seqs == seqs[:2]
    assert scheduler.running == seqs[:2]
    assert list(scheduler.waiting) == seqs[2:]
    assert all(seq.block_table == [] for seq in seqs[2:])


def test_scheduler_admission_respects_token_budget():
    scheduler = make_scheduler(max_num_batched_tokens=25)
    a, b, c = (make_seq(10) for _ in range(3))
    for seq in (a, b, c):
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [10, 10]
    assert batch.num_tokens <= 25
    assert list(scheduler.waiting) == [c]
    run_batch(scheduler, batch)

    batch = scheduler.schedule()  # two decode tokens leave room for c's 10
    assert batch.seqs == [a, b, c] and batch.num_new_tokens == [1, 1, 10]


def test_scheduler_admission_is_fcfs_without_overtaking():
    scheduler = make_scheduler(max_num_batched_tokens=20)
    a = make_seq(4)
    scheduler.add(a)
    step(scheduler)
    long, short = make_seq(20), make_seq(2)
    scheduler.add(long)
    scheduler.add(short)
    batch = scheduler.schedule()  # a decode leaves 19 tokens: `long` does not fit, `short` may not pass it
    assert batch.seqs == [a]
    assert list(scheduler.waiting) == [long, short]
    assert long.block_table == [] and short.block_table == []


def test_scheduler_admission_respects_free_blocks():
    scheduler = make_scheduler(num_blocks=4)
    seqs = [make_seq(2 * BLOCK_SIZE) for _ in range(3)]  # 2 blocks each
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.seqs == seqs[:2]
    assert scheduler.block_manager.num_free_blocks == 0
    assert list(scheduler.waiting) == [seqs[2]]
    assert seqs[2].block_table == []


def test_scheduler_batch_is_in_arrival_order():
    scheduler = make_scheduler()
    seqs = [make_seq(n) for n in (5, 1, 9, 3)]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.seqs == seqs
    assert batch.num_new_tokens == [5, 1, 9, 3]
    assert all(seq.status is SequenceStatus.RUNNING for seq in seqs)
    assert all(len(seq.block_table) == -(-len(seq.token_ids) // BLOCK_SIZE) for seq in seqs)


def test_scheduler_running_sequences_go_before_waiting():
    scheduler = make_scheduler()
    a, b = make_seq(3), make_seq(6)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    c = make_seq(4)
    scheduler.add(c)
    batch = scheduler.schedule()
    assert batch.seqs == [a, b, c]
    assert batch.num_new_tokens == [1, 1, 4]


def test_scheduler_out_of_blocks_preempts_newest_running_sequence():
    scheduler = make_scheduler(num_blocks=4)
    manager = scheduler.block_manager
    a, b = make_seq(2 * BLOCK_SIZE, max_tokens=6), make_seq(2 * BLOCK_SIZE, max_tokens=6)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)  # both prefilled and sampled one token: the pool is full, both need a third block
    late = make_seq(1)
    scheduler.add(late)
    b_blocks = list(b.block_table)

    batch = scheduler.schedule()

    assert batch.preempted == [b]
    assert batch.seqs == [a] and batch.num_new_tokens == [1]
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert b.status is SequenceStatus.WAITING
    assert all(manager.ref_counts[block] == 0 or block in a.block_table for block in b_blocks)
    # Back at the FRONT of the queue, ahead of the request that arrived later.
    assert list(scheduler.waiting) == [b, late]
    # Nothing is admitted in a step that preempted (b, now at the head of the queue, could not fit anyway).
    assert late.block_table == [] and manager.num_free_blocks == 1
    assert scheduler.running == [a]


def test_scheduler_under_block_pressure_oldest_progresses_every_step():
    scheduler = make_scheduler(num_blocks=4)
    a, b, c = (make_seq(2 * BLOCK_SIZE, max_tokens=6) for _ in range(3))
    for seq in (a, b, c):
        scheduler.add(seq)
    preempted = []
    while not a.is_finished:
        computed_before = a.num_computed_tokens
        batch = step(scheduler)
        assert a in batch.seqs and a not in batch.preempted
        assert a.num_computed_tokens > computed_before or a.is_finished
        preempted += batch.preempted
    assert b in preempted  # the pool only fits one of them at full length
    for _ in range(100):
        if not scheduler.has_unfinished():
            break
        step(scheduler)
    assert all(seq.is_finished and seq.num_output_tokens == 6 for seq in (a, b, c))
    assert scheduler.block_manager.num_free_blocks == 4


def test_scheduler_preempted_sequence_recomputes_all_its_tokens():
    scheduler = make_scheduler(num_blocks=4)
    a, b = make_seq(2 * BLOCK_SIZE, max_tokens=3), make_seq(2 * BLOCK_SIZE, max_tokens=3)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    assert step(scheduler).preempted == [b]
    while not a.is_finished:
        step(scheduler)
    batch = scheduler.schedule()
    assert batch.seqs == [b]
    assert batch.num_new_tokens == [b.num_tokens]  # prompt + the token it had already sampled
    assert b.num_tokens == 2 * BLOCK_SIZE + 1


def test_scheduler_sequence_that_is_newest_preempts_itself():
    scheduler = make_scheduler(num_blocks=4)
    a = make_seq(BLOCK_SIZE + 1)  # 2 blocks, room for 3 more tokens
    b = make_seq(2 * BLOCK_SIZE)  # 2 blocks, full
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    batch = scheduler.schedule()
    assert batch.seqs == [a]
    assert batch.preempted == [b]
    assert list(scheduler.waiting) == [b] and b.block_table == []


def test_scheduler_finish_frees_blocks_of_running_and_waiting():
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=1)
    a, b = make_seq(5), make_seq(5)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    scheduler.finish(b)  # still waiting: just leaves the queue
    scheduler.finish(a)
    assert not scheduler.has_unfinished()
    assert a.is_finished and b.is_finished
    assert scheduler.block_manager.num_free_blocks == 4


def test_scheduler_forked_samples_give_up_their_prompt_blocks_before_anyone_else():
    """Forked samples wait holding their prompt's blocks. Once the first sample is preempted they alone would hold
    them, and the older sequence needs more of the pool than the rest: were they kept, it would preempt itself and
    nothing would ever run again (the engine once looped for ever so). Their blocks go first; the oldest runs on."""
    scheduler = make_scheduler(num_blocks=6, max_num_seqs=2)
    older = make_seq(BLOCK_SIZE, max_tokens=4 * BLOCK_SIZE)  # grows to 5 blocks
    first = make_seq(2 * BLOCK_SIZE + 1, max_tokens=3 * BLOCK_SIZE - 1)  # 3 blocks; grows to 5
    samples = [make_seq(first.num_prompt_tokens, first.max_tokens) for _ in range(2)]
    forks = {first: samples}
    scheduler.add(older)
    scheduler.add(first)
    run_batch(scheduler, scheduler.schedule(), forks)
    assert [seq.block_table for seq in samples] == [first.block_table[:2]] * 2  # waiting: max_num_seqs is 2
    preempted = []
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        batch = scheduler.schedule()
        assert batch.seqs or batch.preempted, "no sequence ran, none was preempted: the scheduler is stuck"
        preempted += batch.preempted
        run_batch(scheduler, batch, forks)
    assert first in preempted and older not in preempted
    assert all(seq.is_finished for seq in (older, first, *samples))
    assert older.num_output_tokens == 4 * BLOCK_SIZE
    assert all(seq.num_output_tokens == 3 * BLOCK_SIZE - 1 for seq in (first, *samples))
    assert scheduler.block_manager.num_free_blocks == 6


# ----------------------------------------------------------------------------------------------------------
# Static batching


def test_static_scheduler_admits_next_batch_only_when_nothing_runs():
    scheduler = make_scheduler(cls=StaticScheduler)
    a, b = make_seq(3, max_tokens=2), make_seq(3, max_tokens=4)
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler).seqs == [a, b]
    c = make_seq(2, max_tokens=2)
    scheduler.add(c)
    batch = step(scheduler)  # a finishes here, b still runs
    assert batch.seqs == [a, b]
    assert a.is_finished
    while not b.is_finished:
        assert c not in step(scheduler).seqs  # blocks and slots are free, but the batch is not done
    assert list(scheduler.waiting) == [c]
    assert step(scheduler).seqs == [c]


def test_static_scheduler_reserves_lifetime_blocks_up_front():
    scheduler = make_scheduler(cls=StaticScheduler)
    a = make_seq(3, max_tokens=10)  # 13 tokens in its lifetime: 4 blocks
    scheduler.add(a)
    scheduler.schedule()
    assert len(a.block_table) == 4
    assert scheduler.block_manager.num_free_blocks == 12


def test_static_scheduler_tight_pool_never_preempts():
    scheduler = make_scheduler(num_blocks=6, cls=StaticScheduler)
    seqs = [make_seq(5, max_tokens=7) for _ in range(5)]  # 3 blocks each: 2 fit at once
    for seq in seqs:
        scheduler.add(seq)
    batch_sizes = []
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        blocks_before = {seq.seq_id: list(seq.block_table) for seq in scheduler.running}
        batch = step(scheduler)
        assert batch.preempted == []
        for seq in batch.seqs:
            if seq.seq_id in blocks_before:
                assert seq.block_table == blocks_before[seq.seq_id] or seq.is_finished
        batch_sizes.append(len(batch.seqs))
    assert all(seq.is_finished and seq.num_output_tokens == 7 for seq in seqs)
    assert max(batch_sizes) == 2
    assert scheduler.block_manager.num_free_blocks == 6


# ----------------------------------------------------------------------------------------------------------
# Property: random arrivals, steps, finishes and aborts

POOL_BLOCKS = 6  # 24 tokens: every sequence below fits alone
MAX_PROMPT, MAX_NEW = 12, 10

# One round: some arrivals (prompt length, output length, samples), some engine steps, maybe one sequence ending
# early (EOS), maybe one aborted.
workload_round = st.tuples(
    st.lists(st.tuples(st.integers(1, MAX_PROMPT), st.integers(1, MAX_NEW), st.integers(1, 3)), max_size=3),
    st.integers(0, 4),
    st.none() | st.integers(0, 100),
    st.none() | st.integers(0, 100),
)


def check_step(scheduler: Scheduler, batch: ScheduledBatch, live: list[Sequence], static: bool) -> None:
    manager = scheduler.block_manager
    assert len(batch.seqs) <= scheduler.max_num_seqs
    assert len(scheduler.running) <= scheduler.max_num_seqs
    assert batch.num_tokens <= scheduler.max_num_batched_tokens
    assert len({seq.seq_id for seq in batch.seqs}) == len(batch.seqs)
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
        assert seq in scheduler.running and num_new >= 1
        assert len(seq.block_table) * BLOCK_SIZE >= seq.num_computed_tokens + num_new
    for seq in batch.preempted:
        assert seq in scheduler.waiting and seq.block_table == [] and seq.num_computed_tokens == 0
    if batch.preempted:  # waiting sequences' blocks go before a running one gives way
        assert all(seq.block_table == [] for seq in scheduler.waiting)
    if static:
        assert batch.preempted == []
    for seq in scheduler.waiting:  # only a forked sample waits holding blocks: its prompt's, computed
        assert seq.block_table == [] or seq.num_computed_tokens == len(seq.block_table) * BLOCK_SIZE < seq.num_tokens
    # Each block's reference count is the number of live tables holding it (prefix hits share blocks), and the
    # free list holds exactly the blocks nobody holds: nothing leaked, nothing freed twice.
    holders = Counter(block for seq in live for block in seq.block_table)
    assert manager.ref_counts == [holders[block] for block in range(manager.num_blocks)]
    assert sorted(manager.free_blocks) == [block for block in range(manager.num_blocks) if not holders[block]]


@settings(max_examples=200, deadline=None)
@given(
    rounds=st.lists(workload_round, min_size=1, max_size=10),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(1, 2 * (MAX_PROMPT + MAX_NEW)),
    cls=st.sampled_from([Scheduler, StaticScheduler]),
    prefix_caching=st.booleans(),
    chunked=st.booleans(),
)
def test_scheduler_random_workload_respects_limits_and_frees_every_block(
    rounds, max_num_seqs, budget, cls, prefix_caching, chunked
):
    """Preemption, aborts, prefix caching (every prompt repeats one token, so prefixes are shared), chunked prefill
    and requests of several samples (forked off the first once it has its prompt) together: limits hold every step,
    the scheduler never stalls, and every block comes back exactly once."""
    static = cls is StaticScheduler
    chunked = chunked and not static
    if not chunked:  # without chunks the longest sequence must fit in one step
        budget = max(budget, MAX_PROMPT + MAX_NEW)
    scheduler = make_scheduler(POOL_BLOCKS, max_num_seqs, budget, cls, prefix_caching, chunked)
    live: list[Sequence] = []
    forks: dict[Sequence, list[Sequence]] = {}  # first sample -> the samples it has yet to start

    def do_step():
        batch = scheduler.schedule()
        check_step(scheduler, batch, live, static)
        assert batch.seqs or batch.preempted or not scheduler.has_unfinished(), "the scheduler stalled"
        if batch.preempted:
            event("preempted")
        if any(seq.num_cached_tokens for seq in batch.seqs):
            event("prefix hit")
        if any(seq.block_table for seq in scheduler.waiting):
            event("forked samples waiting")
        for seq in run_batch(scheduler, batch, forks):
            live.remove(seq)

    def end(seq: Sequence) -> None:  # a first sample ends its request's unstarted ones, as an abort would
        scheduler.finish(seq)
        live.remove(seq)
        for sample in forks.pop(seq, []):
            end(sample)
        for samples in forks.values():
            if seq in samples:
                samples.remove(seq)

    for arrivals, num_steps, finish_at, abort_at in rounds:
        for prompt_len, max_tokens, n in arrivals:
            first, *samples = (make_seq(prompt_len, max_tokens) for _ in range(n))
            if samples:
                forks[first] = samples
            live += [first, *samples]
            scheduler.add(first)
        for _ in range(num_steps):
            do_step()
        # EOS comes with a sampled token, after the first sample has started the others.
        eos_candidates = [seq for seq in scheduler.running if seq not in forks]
        if finish_at is not None and eos_candidates:
            end(eos_candidates[finish_at % len(eos_candidates)])
        if abort_at is not None and live:
            end(live[abort_at % len(live)])

    for _ in range(len(live) * (MAX_PROMPT + MAX_NEW) * 4 + 1):
        if not scheduler.has_unfinished():
            break
        do_step()
    assert not scheduler.has_unfinished(), "the scheduler stopped making progress"
    assert live == []
    assert scheduler.block_manager.num_free_blocks == POOL_BLOCKS
    assert scheduler.block_manager.ref_counts == [0] * POOL_BLOCKS


@pytest.mark.parametrize("cls", [Scheduler, StaticScheduler])
def test_scheduler_idle_schedule_is_empty(cls):
    scheduler = make_scheduler(cls=cls)
    batch = scheduler.schedule()
    assert batch.seqs == [] and batch.preempted == [] and not scheduler.has_unfinished()


# Speculative decoding's drafts ---------------------------------------------------------------------------------


def decoding_seqs(scheduler: Scheduler, *prompt_lens: int) -> list[Sequence]:
    """Running sequences whose prompts are computed and whose first tokens are sampled, in one step."""
    seqs = [make_seq(prompt_len, max_tokens=8) for prompt_len in prompt_lens]
    for seq in seqs:
        scheduler.add(seq)
    assert scheduler.schedule().seqs == seqs
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(8)
    return seqs


def test_a_decodes_drafts_are_scheduled_with_it():
    scheduler = make_scheduler(num_blocks=16)
    [seq] = decoding_seqs(scheduler, 6)
    seq.spec_token_ids = [1, 2, 3]
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [4] and seq.spec_token_ids == [1, 2, 3]
    assert len(seq.block_table) * BLOCK_SIZE >= seq.num_tokens + 3


def test_drafts_are_cut_to_the_step_budget():
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=6)
    first, second = decoding_seqs(scheduler, 3, 3)
    first.spec_token_ids, second.spec_token_ids = [1, 2, 3], [4, 5, 6]
    batch = scheduler.schedule()  # room for the first's token and drafts, then the second's token and one draft
    assert batch.seqs == [first, second] and batch.num_new_tokens == [4, 2]
    assert first.spec_token_ids == [1, 2, 3] and second.spec_token_ids == [4]


def test_drafts_take_free_blocks_only_and_never_preempt():
    """A sequence's drafts get the room its blocks and the free ones have once every running sequence's own token
    has its block: a newer sequence that needs the last free block gets it, nobody is preempted for drafts."""
    scheduler = make_scheduler(num_blocks=5)
    older, newer = decoding_seqs(scheduler, 5, 8)  # 6 tokens in two blocks; 9 tokens, whose next needs a third
    assert scheduler.block_manager.num_free_blocks == 1
    older.spec_token_ids = [1, 2, 3]  # positions 6, 7 fit its blocks; 8 would need the free one
    batch = scheduler.schedule()
    assert batch.seqs == [older, newer] and not batch.preempted
    assert batch.num_new_tokens == [3, 1] and older.spec_token_ids == [1, 2]
    assert scheduler.block_manager.num_free_blocks == 0 and len(newer.block_table) == 3


def test_the_last_prompt_token_of_a_chunked_prompt_gets_no_drafts():
    """A prompt whose chunks left its last token: that step is a prompt span, not a decode, and takes no drafts
    (the runner would otherwise sample the drafts' first row from another sequence's row)."""
    scheduler = make_scheduler(num_blocks=16)
    seq = make_seq(9)
    scheduler.add(seq)
    scheduler.schedule()
    seq.num_computed_tokens = 8  # a chunk stopped one token short
    seq.spec_token_ids = [1, 2]
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [1] and seq.spec_token_ids == []


def test_a_step_that_preempts_gives_no_drafts():
    scheduler = make_scheduler(num_blocks=4)
    older, newer = decoding_seqs(scheduler, 8, 8)  # 9 tokens each: each next token needs a third block
    older.spec_token_ids = [1]
    batch = scheduler.schedule()
    assert batch.preempted == [newer] and batch.num_new_tokens == [1] and older.spec_token_ids == []


def test_a_step_that_is_no_decode_drops_drafts():
    """A sequence computed again after a preemption (or a prompt chunk) carries no drafts into its step."""
    scheduler = make_scheduler(num_blocks=16)
    [seq] = decoding_seqs(scheduler, 6)
    seq.spec_token_ids = [1, 2]
    scheduler.running.remove(seq)
    scheduler.preempt(seq)
    batch = scheduler.schedule()
    assert batch.seqs == [seq] and batch.num_new_tokens == [seq.num_tokens] and seq.spec_token_ids == []


def test_static_batches_schedule_drafts_within_the_lifetime_blocks():
    scheduler = make_scheduler(num_blocks=16, cls=StaticScheduler)
    [seq] = decoding_seqs(scheduler, 6)
    seq.spec_token_ids = [1, 2]
    assert scheduler.schedule().num_new_tokens == [3]
