"""Turns a scheduled batch into tensors, runs the model over it and samples the next tokens.

This is the seam where forward-pass optimisations plug in (torch.compile, CUDA graphs, tensor parallelism):
they change how `forward` runs, never what the scheduler or the sampler see.
"""

from __future__ import annotations

import torch
from torch import nn

from liteinfer.engine.compiled import CompiledDecoder
from liteinfer.engine.scheduler import ScheduledBatch
from liteinfer.engine.step_inputs import StepInputs
from liteinfer.engine.workers import WorkerPool, run_step
from liteinfer.layers import AttentionMetadata, PrefillSpan
from liteinfer.sampling import Sampler, SamplerOutput, SamplingRow


class ModelRunner:
    """Rank 0's runner. With tensor parallelism it sends each step's inputs to the other ranks (`workers`), which
    run the same forward on their shards; the logits come back to rank 0 alone, and only rank 0 samples."""

    def __init__(self, model: nn.Module, sampler: Sampler, block_size: int, device: torch.device,
                 workers: WorkerPool | None = None, compiled: CompiledDecoder | None = None):
        self.model = model
        self.sampler = sampler
        self.block_size = block_size
        self.device = device
        self.workers = workers
        self.compiled = compiled  # runs the decode-only steps when set (enforce_eager=False)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[int], SamplerOutput | None]:
        """Run one step; returns the batch positions of the sequences that sampled, and what they sampled.

        A sequence samples when this step computes its last token (a prefill chunk that stops short of the end
        computes K/V only).
        """
        order, input_ids, meta, last_token = self._prepare(batch)
        sampling = [(i, int(last)) for i, last in zip(order, last_token) if last >= 0]
        sample_rows = torch.tensor([row for _, row in sampling], dtype=torch.long, device=self.device)
        step = StepInputs(input_ids, meta, sample_rows)
        try:
            if self.workers is not None:
                self.workers.send(step)
            if self.compiled is not None and self.compiled.accepts(step):
                logits = self.compiled(step)
            else:
                logits = run_step(self.model, step)
        except RuntimeError as exc:  # a collective failed: if a worker died, say so rather than how it showed
            if self.workers is not None:
                self.workers.check(failed=exc)
            raise
        if not sampling:
            return [], None
        seqs = [batch.seqs[i] for i, _ in sampling]
        rows = [SamplingRow(seq.params, seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids, seq.generator)
                for seq in seqs]
        return [i for i, _ in sampling], self.sampler(logits, rows)

    def _prepare(
        self, batch: ScheduledBatch
    ) -> tuple[list[int], torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Lay the step's tokens end to end, decodes first (attention batches them), then multi-token spans.

        Returns the batch order used, input ids, the attention metadata (positions included), and for each sequence (in
        that order) the row of its last token if it samples this step, else -1.
        """
        device, block_size = self.device, self.block_size
        order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_new_tokens[i] > 1)
        seqs = [batch.seqs[i] for i in order]
        query_lens = [batch.num_new_tokens[i] for i in order]
        context_lens = [seq.num_computed_tokens for seq in seqs]
        tokens: list[int] = []
        for seq, start, count in zip(seqs, context_lens, query_lens):
            tokens.extend(seq.token_ids[start : start + count])
        max_blocks = max(len(seq.block_table) for seq in seqs)
        block_tables = torch.tensor(
            [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in seqs], dtype=torch.long
        )

        # Whole-batch index arithmetic: no per-token Python.
        query_lens_t, context_lens_t = torch.tensor(query_lens), torch.tensor(context_lens)
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), query_lens_t)
        query_ends = torch.cumsum(query_lens_t, 0)
        query_starts = query_ends - query_lens_t
        positions = context_lens_t[seq_of_token] + torch.arange(len(tokens)) - query_starts[seq_of_token]
        slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        samples = (context_lens_t + query_lens_t) == torch.tensor([seq.num_tokens for seq in seqs])
        last_token = torch.where(samples, query_ends - 1, -1)

        num_decodes = sum(1 for n in query_lens if n == 1)
        prefills = [
            PrefillSpan(int(start), int(end), torch.tensor(seq.block_table, device=device))
            for seq, start, end in zip(seqs[num_decodes:], query_starts[num_decodes:], query_ends[num_decodes:])
        ]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            positions=positions.to(device),
            decode_block_tables=block_tables[:num_decodes].to(device),
            prefills=prefills,
        )
        return order, torch.tensor(tokens, dtype=torch.long, device=device), meta, last_token
