"""Attention over the paged KV cache.

Every sequence in a step contributes `query_len` new tokens on top of `context_len` tokens whose K/V already sit
in the cache (prefill: context 0; decode: query 1; chunked prefill and prefix-cache hits: both > 0). The new K/V
are written into their slots first; then each query attends to its sequence's keys, read through the block table,
at positions up to its own (and within the sliding window, for layers that have one).

Single-token steps (decodes) are batched into one grouped matmul; each multi-token step (a prefill or a chunk of
one) runs on its own through PyTorch's fused scaled-dot-product attention, so a long prefill never pads the decodes
that share its step and never materialises its [queries, keys] score matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PrefillSpan:
    """A sequence computing several tokens this step."""

    start: int  # its tokens' range [start, end) in the packed batch
    end: int
    block_table: torch.Tensor  # [blocks] the sequence's blocks


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every attention layer (built once per step by the model runner).

    The packed batch holds the decodes first (`num_decodes` tokens, one per sequence), then the prefill spans.
    """

    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) of each new token
    positions: torch.Tensor  # [T] position of each new token in its sequence
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks], padded with block 0 (masked out by position)
    prefills: list[PrefillSpan]


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        # Bound by the model runner to this layer's slice of the pool: [num_blocks, block_size, kv_heads, dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, heads * dim], k, v: [T, kv_heads * dim] -> [T, heads * dim]."""
        num_tokens, dim = q.shape[0], self.head_dim
        k_slots, v_slots = self.k_cache.flatten(0, 1), self.v_cache.flatten(0, 1)  # [slots, kv_heads, dim]
        k_slots.index_copy_(0, meta.slot_mapping, k.view(num_tokens, self.num_kv_heads, dim))
        v_slots.index_copy_(0, meta.slot_mapping, v.view(num_tokens, self.num_kv_heads, dim))
        q = q.view(num_tokens, self.num_heads, dim)

        outputs = []
        decodes = meta.num_decodes
        if decodes:
            tables = meta.decode_block_tables
            keys, values = self.k_cache[tables].flatten(1, 2), self.v_cache[tables].flatten(1, 2)
            outputs.append(self._attend(q[:decodes].unsqueeze(1), keys, values, meta.positions[:decodes, None]))
        for span in meta.prefills:
            positions = meta.positions[span.start : span.end]
            num_keys = int(positions[-1]) + 1
            keys = self.k_cache[span.block_table].flatten(0, 1)[:num_keys]
            values = self.v_cache[span.block_table].flatten(0, 1)[:num_keys]
            outputs.append(self._attend_span(q[span.start : span.end], keys, values, positions))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _attend_span(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """One sequence's new tokens q: [n, heads, dim] against its keys, values: [L, kv_heads, dim]."""
        if self.logit_softcap is not None:  # the fused kernel cannot cap scores before the softmax
            return self._attend(q[None], keys[None], values[None], positions[None])
        # A prompt computed from its start with no window is plain causal attention; otherwise an explicit mask
        # (the kernel's is_causal aligns the first query with the first key, not with its own position).
        plain_causal = self.sliding_window is None and keys.shape[0] == q.shape[0]
        mask = None if plain_causal else ~self._hidden_keys(positions, keys.shape[0])
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, is_causal=plain_causal, scale=self.scale, enable_gqa=True,
        )
        return out.transpose(0, 1).reshape(q.shape[0], self.num_heads * self.head_dim)

    def _hidden_keys(self, query_positions: torch.Tensor, num_keys: int) -> torch.Tensor:
        """[..., Lq, num_keys] True where a key lies after the query or outside its sliding window."""
        key_positions = torch.arange(num_keys, device=query_positions.device)
        hidden = key_positions > query_positions[..., None]
        if self.sliding_window is not None:
            hidden |= key_positions <= query_positions[..., None] - self.sliding_window
        return hidden

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_positions: torch.Tensor
    ) -> torch.Tensor:
        """q: [B, Lq, heads, dim]; keys, values: [B, L, kv_heads, dim] (key j at position j); -> [B * Lq, heads*dim].

        Query heads that share a KV head are stacked into one matrix, so each KV head is read once: GQA becomes
        [B, kv_heads, group * Lq, dim] @ [B, kv_heads, dim, L]. Softmax runs in fp32.
        """
        batch, query_len = q.shape[:2]
        kv_heads, dim = self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        q = q.view(batch, query_len, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, -1, dim)
        scores = torch.matmul(q, keys.permute(0, 2, 3, 1)).float() * self.scale
        if self.logit_softcap is not None:
            scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
        hidden = self._hidden_keys(query_positions, keys.shape[1])  # [B, Lq, L]
        scores = scores.view(batch, kv_heads, group, query_len, -1).masked_fill_(hidden[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(batch, kv_heads, group * query_len, -1)
        out = torch.matmul(probs, values.transpose(1, 2)).view(batch, kv_heads, group, query_len, dim)
        return out.permute(0, 3, 1, 2, 4).reshape(batch * query_len, self.num_heads * dim)
