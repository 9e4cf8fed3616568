"""Which sequences run in the next step, and how many of their tokens.

Continuous batching: every step, running sequences go first (oldest first); if one cannot get a block for its
next tokens, the newest running sequence is preempted — its blocks are freed and it goes back to the front of the
queue to be recomputed later — so the oldest always make progress. Waiting sequences are admitted whenever the
token budget, the sequence limit and free blocks allow (and no one was preempted this step); with prefix caching,
an admitted sequence first takes the cached blocks of its longest cached prefix and computes only the rest.
Waiting sequences hold no blocks, except the samples of an n > 1 request, forked off the first one holding its
prompt's blocks; any sequence that needs blocks the free list lacks takes theirs before anything else gives way.
With chunked prefill, a prompt larger than the step's remaining token budget is computed over several steps, in
chunks that share each step with the decodes of running sequences; while others wait, a running prefill takes at
most `long_prefill_token_threshold` tokens per step, so a long prompt cannot hold back everyone's first token.
With speculative decoding, a decode's draft tokens come last: from what budget and free blocks are left once
everyone's own tokens are scheduled (`_add_drafts`).
Static batching, the simple reference: a batch is admitted only when the previous one has fully finished, with
blocks for its whole lifetime reserved up front, so it never preempts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from liteinfer.cache import BlockManager
from liteinfer.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """Sequences to run this step with how many new tokens each computes (1 for decode)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """Continuous batching with recompute preemption."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = False,
        long_prefill_token_threshold: int | None = None,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold or max(1, max_num_batched_tokens // 4)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.status = SequenceStatus.WAITING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._chunk(seq, budget)
            if self.waiting and num_new > 1:  # a prefill in progress leaves room for newcomers
                num_new = min(num_new, self.long_prefill_token_threshold)
            if num_new == 0:
                break
            if self._grow_or_preempt(seq, num_new, batch):
                batch.add(seq, num_new)
                budget -= num_new
                i += 1
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        self._add_drafts(batch)
        return batch

    def _add_drafts(self, batch: ScheduledBatch) -> None:
        """Give each scheduled decode as many of its draft tokens (speculative decoding) as the step's leftover
        budget and the free blocks hold, oldest first, and drop the rest: drafts come after every running
        sequence's own token and every newcomer, so they never preempt or hold back anyone. Only the decode of a
        generated token drafts (not a prompt's last token, not a recompute), and none in a step that preempted."""
        budget = self.max_num_batched_tokens - batch.num_tokens
        block_size, free_blocks = self.block_manager.block_size, self.block_manager.num_free_blocks
        for k, seq in enumerate(batch.seqs):
            if not seq.spec_token_ids:
                continue
            keep, end = 0, seq.num_computed_tokens + 1
            decodes_generated_token = batch.num_new_tokens[k] == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
            if decodes_generated_token and not batch.preempted:
                room = (len(seq.block_table) + free_blocks) * block_size - end
                keep = max(0, min(len(seq.spec_token_ids), budget, room))
            del seq.spec_token_ids[keep:]
            if keep:
                had = len(seq.block_table)
                self.block_manager.allocate(seq.block_table, end + keep)  # (room counted the free blocks)
                free_blocks -= len(seq.block_table) - had
                batch.num_new_tokens[k] += keep
                budget -= keep

    def _grow_or_preempt(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        """Give `seq` blocks for its new tokens, preempting from the newest end; False if `seq` itself went."""
        while not self._allocate(seq, num_new):
            victim = self.running.pop()
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """How many of `seq`'s uncomputed tokens fit this step (0: none can)."""
        num_new = seq.num_tokens - seq.num_computed_tokens
        if num_new <= budget:
            return num_new
        return budget if self.enable_chunked_prefill else 0

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            # Forked samples arrive holding their prompt's blocks; a sequence scoring its prompt computes it all.
            looked_up = not seq.block_table and not seq.scores_prompt
            if looked_up:
                seq.block_table = self.block_manager.match_prefix(seq.token_ids, seq.block_hashes)
                seq.num_computed_tokens = len(seq.block_table) * self.block_manager.block_size
            num_new = self._chunk(seq, budget)
            if num_new == 0 or not self._allocate(seq, num_new):
                # A waiting sequence must not pin blocks (cached or forked) that running ones may need.
                self._release(seq)
                break
            self.waiting.popleft()
            if looked_up:
                self.prefix_queried_tokens += seq.num_tokens
                self.prefix_hit_tokens += seq.num_computed_tokens
            if seq.num_cached_tokens is None:  # first admitted: a recompute after a preemption is no cache hit
                seq.num_cached_tokens = seq.num_computed_tokens if looked_up else 0
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new

    @property
    def prefix_hit_rate(self) -> float:
        """Share of the prompt tokens looked up in the prefix cache that were found there."""
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    def _allocate(self, seq: Sequence, num_new: int) -> bool:
        """Blocks for `seq`'s next `num_new` tokens: from the free list, or else from the waiting sequences that hold
        some (forked samples). Left to them, their blocks could keep the oldest sequence from ever finishing (the
        engine once looped for ever so): they compute their prompt again when they start, or find it cached."""
        while not self.block_manager.allocate(seq.block_table, seq.num_computed_tokens + num_new):
            holders = [other for other in self.waiting if other.block_table and other is not seq]
            if not holders:
                return False
            for other in holders:
                self._release(other)
        return True

    def _release(self, seq: Sequence) -> None:
        """Free `seq`'s blocks: it will compute all its tokens again (or find its prefix cached)."""
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        self.add(seq, front=True)

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.status = SequenceStatus.FINISHED


class StaticScheduler(Scheduler):
    """Fixed batches run to completion; the reference the continuous scheduler is checked against."""

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        if not self.running:
            self._admit_batch(batch)
            return batch
        for seq in self.running:  # (its blocks last its lifetime: drafts never pass its last position)
            batch.add(seq, seq.num_tokens + len(seq.spec_token_ids) - seq.num_computed_tokens)
        return batch

    def _admit_batch(self, batch: ScheduledBatch) -> None:
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = seq.num_tokens - seq.num_computed_tokens
            lifetime_tokens = seq.num_tokens + seq.max_tokens - seq.num_output_tokens
            if num_new > budget or not self.block_manager.allocate(seq.block_table, lifetime_tokens):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new
