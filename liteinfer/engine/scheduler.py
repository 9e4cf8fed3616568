"""Which sequences run in the next step, and how many of their tokens.

Continuous batching: every step, running sequences go first (oldest first); if one cannot get a block for its
next token, the newest running sequence is preempted — its blocks are freed and it goes back to the front of the
queue to be recomputed later — so the oldest always make progress. Waiting sequences are admitted whenever the
token budget, the sequence limit and free blocks allow (and no one was preempted this step).
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

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

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
            num_new = seq.num_tokens - seq.num_computed_tokens
            if num_new > budget:
                break
            if self._grow_or_preempt(seq, num_new, batch):
                batch.add(seq, num_new)
                budget -= num_new
                i += 1
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        return batch

    def _grow_or_preempt(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        """Give `seq` blocks for its new tokens, preempting from the newest end; False if `seq` itself went."""
        while not self.block_manager.allocate(seq.block_table, seq.num_computed_tokens + num_new):
            victim = self.running.pop()
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = seq.num_tokens - seq.num_computed_tokens
            if num_new > budget or not self.block_manager.allocate(seq.block_table, seq.num_tokens):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new

    def preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0
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
        for seq in self.running:
            batch.add(seq, seq.num_tokens - seq.num_computed_tokens)
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
