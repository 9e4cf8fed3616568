"""What rank 0 sends the other tensor-parallel ranks each step, and its wire format.

Every rank runs the same forward over the same packed batch, so each needs the step's token ids, positions, cache
slots and block tables; the scheduler, the sequences and the sampler stay on rank 0. All of it is small integers,
packed into one int64 buffer: 4 per new token (id, position, cache block and row in it), the block tables of the
sequences in the step (one int per `block_size` tokens of context: the only part that grows with sequence length),
4 per prefill span and 1 per row whose logits are computed. A decode step of 64 sequences at 1k tokens of context
with 16-token blocks is about 5k ints (40 KB); no text, no logits, no K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liteinfer.layers import AttentionMetadata, PrefillSpan

_HEADER = 6  # num_tokens, num_decodes, max_blocks, num_prefills, num_sample_rows, num_sampling


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    meta: AttentionMetadata  # its positions are the tokens' positions
    sample_rows: torch.Tensor  # [N] rows of the packed batch whose logits are computed: the sampling tokens, then any
    # prompt positions scored for their logprobs
    num_sampling: int  # how many of `sample_rows` sample (the rest are scored)

    @property
    def decode_only(self) -> bool:
        """Every token a decode, and every row sampling: what a compiled decode step takes."""
        return self.meta.num_decodes == len(self.input_ids) == len(self.sample_rows)

    def to_bytes(self) -> bytes:
        meta = self.meta
        decode_tables = meta.decode_block_tables
        spans = torch.tensor([[s.start, s.end, s.num_keys, len(s.block_table)] for s in meta.prefills],
                             dtype=torch.long)
        header = torch.tensor([len(self.input_ids), meta.num_decodes, decode_tables.shape[1] if meta.num_decodes else 0,
                               len(meta.prefills), len(self.sample_rows), self.num_sampling])
        span_tables = torch.tensor([block for s in meta.prefills for block in s.block_table], dtype=torch.long)
        parts = [header, self.input_ids, meta.positions, meta.slot_blocks, meta.slot_offsets, decode_tables.flatten(),
                 spans.flatten(), span_tables, self.sample_rows]
        return torch.cat([p.to("cpu", torch.long) for p in parts]).numpy().tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, device: torch.device) -> StepInputs:
        flat = torch.frombuffer(bytearray(data), dtype=torch.long)
        num_tokens, num_decodes, max_blocks, num_prefills, num_rows, num_sampling = flat[:_HEADER].tolist()
        offset = _HEADER

        def take(count: int) -> torch.Tensor:
            nonlocal offset
            offset += count
            return flat[offset - count : offset]

        input_ids, positions = take(num_tokens), take(num_tokens)
        slot_blocks, slot_offsets = take(num_tokens), take(num_tokens)
        decode_tables = take(num_decodes * max_blocks).view(num_decodes, max_blocks)
        spans = take(num_prefills * 4).view(num_prefills, 4).tolist()
        prefills = [PrefillSpan(start, end, take(blocks).tolist(), keys) for start, end, keys, blocks in spans]
        sample_rows = take(num_rows)
        meta = AttentionMetadata(
            slot_blocks=slot_blocks.to(device),
            slot_offsets=slot_offsets.to(device),
            positions=positions.to(device),
            decode_block_tables=decode_tables.to(device),
            prefills=prefills,
        )
        return cls(input_ids.to(device), meta, sample_rows.to(device), num_sampling)
