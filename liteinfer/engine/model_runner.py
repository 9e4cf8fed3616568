"""Turns a scheduled batch into tensors, runs the model over it and samples the next tokens.

This is the seam where forward-pass optimisations plug in (torch.compile, CUDA graphs, tensor parallelism):
they change how `forward` runs, never what the scheduler or the sampler see.
"""

from __future__ import annotations

import torch
from torch import nn

from liteinfer.engine.scheduler import ScheduledBatch
from liteinfer.layers import AttentionMetadata
from liteinfer.sampling import Sampler, SamplerOutput, SamplingRow


class ModelRunner:
    def __init__(self, model: nn.Module, sampler: Sampler, block_size: int, device: torch.device):
        self.model = model
        self.sampler = sampler
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[int], SamplerOutput | None]:
        """Run one step; returns the batch positions of the sequences that sampled, and what they sampled.

        A sequence samples when this step computes its last token (a prefill chunk that stops short of the end
        computes K/V only).
        """
        input_ids, positions, meta, sample_at = self._prepare(batch)
        hidden = self.model(input_ids, positions, meta)
        sampling = [i for i, seq in enumerate(batch.seqs) if sample_at[i] >= 0]
        if not sampling:
            return [], None
        logits = self.model.compute_logits(hidden[sample_at[sampling]])
        rows = [
            SamplingRow(seq.params, seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids, seq.generator)
            for seq in (batch.seqs[i] for i in sampling)
        ]
        return sampling, self.sampler(logits, rows)

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        seqs, device, block_size = batch.seqs, self.device, self.block_size
        context_lens = [seq.num_computed_tokens for seq in seqs]
        query_lens = batch.num_new_tokens
        tokens: list[int] = []
        for seq, start, count in zip(seqs, context_lens, query_lens):
            tokens.extend(seq.token_ids[start : start + count])
        max_blocks = max(len(seq.block_table) for seq in seqs)
        block_tables = torch.tensor(
            [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in seqs], dtype=torch.long
        )

        # Everything below is whole-batch index arithmetic: no per-token Python.
        num_seqs, max_query_len = len(seqs), max(query_lens)
        query_lens_t = torch.tensor(query_lens)
        context_lens_t = torch.tensor(context_lens)
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), query_lens_t)
        query_starts = torch.cumsum(query_lens_t, 0) - query_lens_t
        offset_in_query = torch.arange(len(tokens)) - query_starts[seq_of_token]
        positions = context_lens_t[seq_of_token] + offset_in_query
        slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        token_to_padded = seq_of_token * max_query_len + offset_in_query

        # A key is visible to a query at or after its position; that also hides unused block-table slots. Padded
        # query rows keep position 0 (seeing key 0 keeps their softmax finite); their output is dropped.
        query_positions = torch.zeros(num_seqs * max_query_len, dtype=torch.long)
        query_positions.index_copy_(0, token_to_padded, positions)
        key_positions = torch.arange(max_blocks * block_size)
        visible = key_positions.view(1, 1, -1) <= query_positions.view(num_seqs, max_query_len, 1)
        attn_bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))

        done = context_lens_t + query_lens_t
        num_tokens_t = torch.tensor([seq.num_tokens for seq in seqs])
        last_token = query_starts + query_lens_t - 1
        sample_at = torch.where(done == num_tokens_t, last_token, -1)

        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            block_tables=block_tables.to(device),
            token_to_padded=token_to_padded.to(device),
            attn_bias=attn_bias.view(num_seqs, 1, 1, max_query_len, -1).to(device),
            max_query_len=max_query_len,
        )
        input_ids = torch.tensor(tokens, dtype=torch.long, device=device)
        return input_ids, positions.to(device), meta, sample_at.to(device)
