"""Turns a scheduled batch into tensors, runs the model over it and samples the next tokens.

This is the seam where forward-pass optimisations plug in (torch.compile, CUDA graphs, tensor parallelism):
they change how `forward` runs, never what the scheduler or the sampler see.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from liteinfer.engine.compiled import CompiledDecoder
from liteinfer.engine.packaged import PackagedDecoder
from liteinfer.engine.scheduler import ScheduledBatch
from liteinfer.engine.sequence import Sequence
from liteinfer.engine.step_inputs import StepInputs
from liteinfer.engine.workers import WorkerPool, head_groups, sampling_hidden
from liteinfer.layers import AttentionMetadata, PrefillSpan
from liteinfer.outputs import PositionLogprobs
from liteinfer.sampling import Sampler, SamplerOutput, SamplingRow
from liteinfer.sampling.sampler import gather_logprobs


class ModelRunner:
    """Rank 0's runner. With tensor parallelism it sends each step's inputs to the other ranks (`workers`), which
    run the same forward on their shards; the logits come back to rank 0 alone, and only rank 0 samples."""

    def __init__(self, model: nn.Module, sampler: Sampler, block_size: int, device: torch.device,
                 workers: WorkerPool | None = None, compiled: CompiledDecoder | PackagedDecoder | None = None):
        self.model = model
        self.sampler = sampler
        self.block_size = block_size
        self.device = device
        self.workers = workers
        self.compiled = compiled  # runs the decode-only steps when set (enforce_eager=False)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run one step: the tokens of the sequences that sample, and the prompt logprobs of those scoring prompt
        positions this step.

        A sequence samples when this step computes its last token (a prefill chunk that stops short of the end
        computes K/V only).
        """
        input_ids, meta, sampling, scored = self._prepare(batch)
        score_rows = [row for _, first_row, positions in scored for row in range(first_row, first_row + len(positions))]
        logit_rows = torch.tensor([row for _, row, _ in sampling] + score_rows, dtype=torch.long, device=self.device)
        step = StepInputs(input_ids, meta, logit_rows, len(sampling))
        rows = []
        for i, _, drafts in sampling:  # a draft's row samples as if the drafts before it were output already
            seq = batch.seqs[i]
            token_ids = seq.token_ids + seq.spec_token_ids[:drafts] if drafts else seq.token_ids
            rows.append(SamplingRow(seq.params, token_ids, seq.num_prompt_tokens, seq.seed,
                                    seq.bad_words_token_ids, seq.grammar))
        result = StepResult([i for i, _, _ in sampling])
        try:
            if self.workers is not None:
                self.workers.send(step)
            if self.compiled is not None and step.decode_only:
                hidden = self.compiled(step)
            else:
                hidden = sampling_hidden(self.model, step)
            if not scored:
                result.sampled = self._sample(hidden, rows) if sampling else None
                return result
            # The head calls in the groups every rank makes (with tensor parallelism each call is a collective).
            groups = head_groups(hidden, len(sampling))
            result.sampled = self.sampler(self.model.compute_logits(groups.pop(0)), rows) if sampling else None
            result.prompt_logprobs = self._score_prompts(groups, batch, scored)
        except RuntimeError as exc:  # a collective failed: if a worker died, say so rather than how it showed
            if self.workers is not None:
                self.workers.check(failed=exc)
            raise
        return result

    def _sample(self, hidden: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """The LM head and the sampler on the sampling rows' hidden states. A step whose rows all take their logits'
        argmax asks the head for it first, which some heads find without computing every logit."""
        argmax = self.model.greedy_tokens(hidden) if self.sampler.takes_argmax(rows) else None
        if argmax is None:
            return self.sampler(self.model.compute_logits(hidden), rows)
        return self.sampler.from_argmax(argmax.tolist(), rows, lambda held: self.model.compute_logits(hidden[held]))

    def _score_prompts(self, groups: list[torch.Tensor], batch: ScheduledBatch,
                       scored: list[tuple[int, int, range]]) -> dict[int, list[PositionLogprobs]]:
        """The logprobs of the prompt tokens that the scored positions' hidden states (`groups` of them, in order)
        predict, each with the top `prompt_logprobs` tokens at its position; by batch position. Each group's logits
        are made and reduced before the next's."""
        next_tokens, num_top = [], []
        for i, _, positions in scored:
            seq = batch.seqs[i]
            next_tokens += seq.token_ids[positions.start + 1 : positions.stop + 1]
            num_top += [seq.params.prompt_logprobs] * len(positions)
        tokens = torch.tensor(next_tokens, dtype=torch.long, device=self.device)
        tops: list[PositionLogprobs] = []
        for group in groups:
            rows = slice(len(tops), len(tops) + len(group))
            logprobs = self.model.compute_logits(group).log_softmax(-1, dtype=torch.float32)
            tops += gather_logprobs(logprobs, tokens[rows], num_top[rows])[1]
        by_seq, at = {}, 0
        for i, _, positions in scored:
            by_seq[i], at = tops[at : at + len(positions)], at + len(positions)
        return by_seq

    def _prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, AttentionMetadata, list[tuple[int, int]], list[tuple[int, int, range]]]:
        """Lay the step's tokens end to end: generated tokens first, each a decode (attention batches them), then
        each sequence's prompt tokens as one span.

        A token takes the path of what it is, whatever the step's shape, because the two attention kernels round
        otherwise (with int8 pools the decode kernel also rounds the query to 8 bits) and a sequence's logits must
        not depend on how its steps were cut. Prompt tokens form a span even one at a time (the last token of a
        cached or forked prompt, a one-token chunk): else a greedy n > 1 request's forked samples could depart from
        its first. Generated tokens are decodes even when computed again after a preemption, several of one
        sequence in a step, each reading the keys up to its own position (this step writes them before attention
        reads): else the preempted sequence would continue from other K/V than it had.

        A sequence's draft tokens (speculative decoding) follow its last token as decodes, and each of these rows
        samples: the token after the last one, then after each draft.

        Returns the input ids, the attention metadata (positions included), (batch position, row, drafts before it)
        of each row that samples this step, in row order, and (batch position, row of the first, positions) of the
        prompt positions scored this step (`Sequence.prompt_positions_to_score`).
        """
        device, block_size = self.device, self.block_size
        # Built as Python lists, turned into tensors once: each torch op on a tiny tensor costs microseconds, several
        # times more with the caches cold after a forward pass, and a decode step of one sequence is milliseconds.
        # The Python work is per sequence, and per block (not per token) for the slots.
        tokens: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        decode_tables: list[list[int]] = []
        prefills: list[PrefillSpan] = []
        sampling: list[tuple[int, int, int]] = []
        scored: list[tuple[int, int, range]] = []

        def lay(seq: Sequence, start: int, end: int) -> int:
            """Append the rows of positions [start, end) of `seq`; returns the first one's row."""
            row = len(tokens)
            tokens.extend(seq.token_ids[start:end])
            if end > seq.num_tokens:  # its drafts, after its tokens
                tokens.extend(seq.spec_token_ids[: end - seq.num_tokens])
            positions.extend(range(start, end))
            blocks, offsets = cache_slots(seq.block_table, start, end, block_size)
            slot_blocks.extend(blocks)
            slot_offsets.extend(offsets)
            return row

        spans = []  # laid after every decode
        for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + count
            split = min(max(seq.num_prompt_tokens, start), end)  # [start, split) are prompt tokens, the rest generated
            drafts = len(seq.spec_token_ids)  # (the scheduler keeps only those this step computes)
            samples = end == seq.num_tokens + drafts
            if split < end:
                row = lay(seq, split, end)
                decode_tables.extend([seq.block_table] * (end - split))
                if samples:
                    sampling += [(i, row + end - split - 1 - drafts + j, j) for j in range(drafts + 1)]
            if start < split:
                spans.append((i, seq, start, split, samples and split == end))
        for i, seq, start, split, samples in spans:
            row = lay(seq, start, split)
            prefills.append(PrefillSpan(row, row + split - start, seq.block_table, split))
            if samples:
                sampling.append((i, row + split - start - 1, 0))
            if to_score := seq.prompt_positions_to_score(start, split):
                scored.append((i, row + to_score.start - start, to_score))
        # Padding is block 0, masked out by position.
        width = max(map(len, decode_tables), default=0)
        padded = [table + [0] * (width - len(table)) for table in decode_tables]
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=device),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            decode_block_tables=torch.tensor(padded, dtype=torch.long, device=device).view(len(padded), width),
            prefills=prefills,
        )
        return torch.tensor(tokens, dtype=torch.long, device=device), meta, sampling, scored


@dataclass
class StepResult:
    """What one step gives the engine, by batch position."""

    sampled_seqs: list[int]  # the sequence of each of `sampled`'s rows (one with drafts has one more row each)
    sampled: SamplerOutput | None = None
    prompt_logprobs: dict[int, list[PositionLogprobs]] = field(default_factory=dict)  # of those scoring their prompt


def cache_slots(block_table: list[int], start: int, end: int, block_size: int) -> tuple[list[int], list[int]]:
    """The cache slots of positions [start, end) of a sequence with this block table, as the block and the row in
    it of each: a run of rows per block."""
    blocks: list[int] = []
    offsets: list[int] = []
    for first in range(start - start % block_size, end, block_size):  # the first position of each block touched
        lo, hi = max(start, first), min(end, first + block_size)
        blocks += [block_table[first // block_size]] * (hi - lo)
        offsets += range(lo - first, hi - first)
    return blocks, offsets
