"""Attention over the paged KV cache.

One code path serves every kind of step: a sequence contributes `query_len` new tokens on top of `context_len`
tokens whose K/V already sit in the cache (prefill: context 0; decode: query 1; chunked prefill and prefix-cache
hits: both > 0). The new K/V are written into their slots first, then each sequence's keys are read through its
block table and every query attends to the keys at positions up to its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every attention layer (built once per step by the model runner)."""

    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [B, max_blocks] block ids of each sequence, padded with block 0
    # Queries are processed padded to [B, max_query_len]; `token_to_padded[t]` is packed token t's row there.
    token_to_padded: torch.Tensor  # [T]
    # Additive mask [B, 1, 1, max_query_len, max_blocks * block_size]: 0 where a query may see a key, -inf where
    # the key lies after the query's position (this also hides padding and unused block-table slots).
    attn_bias: torch.Tensor
    max_query_len: int


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        # Bound by the model runner to this layer's slice of the pool: [num_blocks, block_size, kv_heads, dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, heads * dim], k, v: [T, kv_heads * dim] -> [T, heads * dim]."""
        num_tokens = q.shape[0]
        kv_heads, dim = self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        k_cache, v_cache = self.k_cache, self.v_cache
        k_cache.view(-1, kv_heads, dim).index_copy_(0, meta.slot_mapping, k.view(num_tokens, kv_heads, dim))
        v_cache.view(-1, kv_heads, dim).index_copy_(0, meta.slot_mapping, v.view(num_tokens, kv_heads, dim))

        batch, query_len = meta.block_tables.shape[0], meta.max_query_len
        q = q.view(num_tokens, self.num_heads, dim)
        if query_len > 1:  # decode steps are already one row per sequence
            q = q.new_zeros(batch * query_len, self.num_heads, dim).index_copy_(0, meta.token_to_padded, q)
        # Query heads that share a KV head are stacked into one matrix, so each KV head is read once: GQA
        # becomes [B, kv_heads, group * query_len, dim] @ [B, kv_heads, dim, keys].
        q = q.view(batch, query_len, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(batch, kv_heads, group * query_len, dim)
        keys = k_cache[meta.block_tables].flatten(1, 2).transpose(1, 2)  # [B, kv_heads, keys, dim]
        values = v_cache[meta.block_tables].flatten(1, 2).transpose(1, 2)

        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * self.scale
        scores = scores.view(batch, kv_heads, group, query_len, -1) + meta.attn_bias
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(batch, kv_heads, group * query_len, -1)
        out = torch.matmul(probs, values).view(batch, kv_heads, group, query_len, dim)
        out = out.permute(0, 3, 1, 2, 4).reshape(batch * query_len, self.num_heads * dim)
        return out if query_len == 1 else out[meta.token_to_padded]
