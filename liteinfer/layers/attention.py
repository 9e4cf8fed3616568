"""Attention over the paged KV cache.

Every sequence in a step contributes `query_len` new tokens on top of `context_len` tokens whose K/V already sit
in the cache (prefill: context 0; decode: query 1; chunked prefill and prefix-cache hits: both > 0). The new K/V
are written into their slots first; then each query attends to its sequence's keys, read through the block table,
at positions up to its own (and within the sliding window, for layers that have one).

The pools hold K/V in the model's dtype, or in bytes at a scale per row (`kv_cache_dtype="int8"`), which the kernels
read as they lie and the other paths dequantize after gathering.

Decodes (generated tokens: one per sequence, or several of one sequence that computes them again after a preemption,
each reading the keys up to its own position) are batched into one call of a kernel that reads each sequence's blocks
where they lie in the pool: on CPU ours in C++ (liteinfer.kernels), on CUDA ours in Triton
(kernels/triton_attention.py) where Triton is installed; elsewhere, or where the C++ kernels could not be built, a
grouped matmul over a gathered copy of the blocks. Spans (a prompt, a chunk of one, even a single prompt token, or
a prompt computed again after a preemption) are batched into one call of our prompt kernel on AVX-512 CPUs (head sizes
64 and 128, no soft-capping; at any length) or of our Triton one on CUDA (blocks of 16 keys or more); otherwise each
runs on its own through PyTorch's fused scaled-dot-product attention. Either way a long prefill never pads the
decodes that share its step and never materialises its [queries, keys] score matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from liteinfer import kernels

try:  # CUDA's kernels; CPU-only machines need no Triton
    from liteinfer.kernels.triton_attention import paged_decode_attention as triton_paged_decode_attention
    from liteinfer.kernels.triton_attention import paged_prefill_attention as triton_paged_prefill_attention
except ImportError:
    triton_paged_decode_attention = triton_paged_prefill_attention = None

@dataclass
class PrefillSpan:
    """A sequence computing a span of its prompt tokens this step: one or more (a whole prompt, a chunk, its last
    token alone, a prompt computed again after a preemption)."""

    start: int  # its tokens' range [start, end) in the packed batch
    end: int
    # The sequence's blocks, on the host: the step's spans reach the device together, in one padded table
    # (`AttentionMetadata.prefill_spans`), not one copy per span.
    block_table: list[int]
    # Keys its last token attends to (its sequence's length through this step), known on the host: read from the
    # positions on a GPU, it would wait for the device once per span and layer.
    num_keys: int


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every attention layer (built once per step by the model runner).

    The packed batch holds the decodes first (`num_decodes` generated tokens, each with its block table), then the
    prefill spans.
    """

    slot_blocks: torch.Tensor  # [T] the pool block that holds each new token's K/V
    slot_offsets: torch.Tensor  # [T] its row within that block
    positions: torch.Tensor  # [T] position of each new token in its sequence
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks], padded with block 0 (masked out by position)
    prefills: list[PrefillSpan]

    @property
    def num_decodes(self) -> int:
        # A size, not a stored int: under torch.compile it stays symbolic with the batch instead of fixing it.
        return self.decode_block_tables.shape[0]

    @cached_property
    def prefill_spans(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The spans as the prompt kernels take them, built once a step: rows [S + 1] where each span starts (counted
        from the first prefill row; the last entry is where they end), and block tables [S, width] padded with 0."""
        first, device = self.prefills[0].start, self.positions.device
        starts = [span.start - first for span in self.prefills] + [self.prefills[-1].end - first]
        width = max(len(span.block_table) for span in self.prefills)
        tables = [span.block_table + [0] * (width - len(span.block_table)) for span in self.prefills]
        return torch.tensor(starts, device=device), torch.tensor(tables, device=device)

    @cached_property
    def longest_prefill(self) -> int:
        """Tokens in the step's longest span (the grid of the Triton prompt kernel), counted once a step."""
        return max(span.end - span.start for span in self.prefills)


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
        # Bound by the model runner to this layer's slice of the pool: [num_blocks, kv_heads, block_size, dim]; int8
        # pools (kv_cache_dtype="int8") come with their rows' scales, in the layout kernels/__init__.py gives.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, heads * dim], k, v: [T, kv_heads * dim] -> [T, heads * dim]."""
        num_tokens, dim, kv_heads = q.shape[0], self.head_dim, self.num_kv_heads
        k, v = k.view(num_tokens, kv_heads, dim), v.view(num_tokens, kv_heads, dim)
        if self.k_scales is not None:
            self._write_int8(k, v, meta)
        elif kernels.pointwise_takes(k) and self.k_cache.dtype == k.dtype:  # one call where indexing costs ~10 us each
            torch.ops.liteinfer.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_blocks, meta.slot_offsets)
        else:
            self.k_cache[meta.slot_blocks, :, meta.slot_offsets] = k
            self.v_cache[meta.slot_blocks, :, meta.slot_offsets] = v
        q = q.view(num_tokens, self.num_heads, dim)

        outputs = []
        decodes = meta.num_decodes
        if decodes:
            outputs.append(self._attend_decodes(q[:decodes], meta.decode_block_tables, meta.positions[:decodes]))
        if meta.prefills:
            outputs.append(self._attend_prefills(q[decodes:], meta))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _attend_prefills(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's multi-token spans, q: [P, heads, dim] (the rows after the decodes) -> [P, heads * dim]."""
        decodes = meta.num_decodes
        if self._prompt_kernel_takes(q):
            starts, tables = meta.prefill_spans
            return torch.ops.liteinfer.paged_prefill_attention(
                q, self.k_cache, self.v_cache, tables, starts, meta.positions[decodes:], self.scale,
                self.sliding_window or 0, self.k_scales, self.v_scales,
            ).flatten(1)
        if (q.is_cuda and triton_paged_prefill_attention is not None and self.k_scales is None
                and self.k_cache.shape[2] >= 16):  # the kernel's matrix products want blocks of 16 keys or more
            starts, tables = meta.prefill_spans
            return triton_paged_prefill_attention(
                q, self.k_cache, self.v_cache, tables, starts, meta.positions[decodes:], self.scale,
                meta.longest_prefill, self.sliding_window or 0, self.logit_softcap or 0.0,
            ).flatten(1)
        outputs = []
        _, tables = meta.prefill_spans
        for i, span in enumerate(meta.prefills):
            positions, num_keys = meta.positions[span.start : span.end], span.num_keys
            keys, values = self._gather(tables[i : i + 1, : len(span.block_table)], q.dtype)
            keys, values = keys[:, 0, :num_keys], values[:, 0, :num_keys]  # [kv_heads, num_keys, dim]
            outputs.append(self._attend_span(q[span.start - decodes : span.end - decodes], keys, values, positions))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _prompt_kernel_takes(self, q: torch.Tensor) -> bool:
        """Our prompt kernel: on AVX-512 CPUs, for head sizes 64 and 128 without soft-capping, at any length. One
        span, one layer of SmolLM2's shape, 2 threads, against SDPA over the span's gathered blocks (the path
        otherwise) on an AMD Zen 4: bf16 1,024 / 8,192 keys 5.0 / 270 ms against 13.1 / 585, fp32 8.1 / 509 against
        14.6 / 595 (docs/benchmarks.md, "2026-12-07 (04:39")."""
        return (q.is_cpu and self.logit_softcap is None and self.head_dim in (64, 128) and kernels.prefill_available()
                and self._kernels_take_pools())

    def _kernels_take_pools(self) -> bool:
        """Plain pools, or int8 ones where the kernels read them (AVX-512 VNNI, heads of 64 or 128, whole panels of 16
        keys a block); otherwise int8 pools are read through `_gather`."""
        return self.k_scales is None or (kernels.int8_pools_available() and self.head_dim in (64, 128)
                                         and self.k_scales.shape[2] % 16 == 0)

    def _write_int8(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """The new rows into int8 pools (layout in kernels/__init__.py), each at its own scale: its largest |element|
        / 127. Our op does it in one pass, in compiled graphs too (inductor's kernels for the PyTorch form took ~0.1 ms
        a layer at a decode step of ~200 sequences, docs/benchmarks.md); where the kernels are not built, the same
        arithmetic in PyTorch ops, which index the pools themselves, not views of them, so that a compiled step's
        writes stay in place."""
        blocks, offsets = meta.slot_blocks, meta.slot_offsets
        if kernels.pointwise_takes(k, in_graphs=True):
            torch.ops.liteinfer.write_kv_int8(k, v, self.k_cache, self.v_cache, self.k_scales, self.v_scales, blocks,
                                              offsets)
            return
        k_levels, k_scales = _int8_levels(k)
        v_levels, v_scales = _int8_levels(v)
        self.k_cache[blocks, :, :, offsets] = (k_levels + 128).to(torch.uint8).unflatten(-1, (-1, 4))
        self.v_cache[blocks, :, offsets // 4, :, offsets % 4] = v_levels.to(torch.int8)
        self.k_scales[blocks, :, offsets] = k_scales
        self.v_scales[blocks, :, offsets] = v_scales

    def _gather(self, block_tables: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V of each sequence's blocks in `dtype`, [kv_heads, seqs, blocks * block_size, dim].

        The blocks are selected along the pool's own first dimension, then moved heads-first: selecting from the pool
        viewed heads-first made PyTorch copy the whole pool into that order first, every call (~15 ms a layer for a
        2 GiB pool; prompts on CPUs without the prompt kernel took 37 s to prefill 32 requests)."""
        seqs, width = block_tables.shape
        flat = block_tables.flatten()
        keys, values = self.k_cache.index_select(0, flat), self.v_cache.index_select(0, flat)
        if self.k_scales is not None:  # int8 pools, dequantized
            keys = keys.transpose(2, 3).flatten(3, 4).float()  # [blocks, kv_heads, block_size, dim]
            keys = ((keys - 128) * self.k_scales.index_select(0, flat)[..., None]).to(dtype)
            values = values.transpose(-1, -2).flatten(2, 3).float()  # [blocks, kv_heads, block_size, dim]
            values = (values * self.v_scales.index_select(0, flat)[..., None]).to(dtype)
        return tuple(
            pool.unflatten(0, (seqs, width)).permute(2, 0, 1, 3, 4).reshape(self.num_kv_heads, seqs, -1, self.head_dim)
            for pool in (keys, values)
        )

    def _attend_decodes(self, q: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Generated tokens, each against its keys up to its position, q: [D, heads, dim] -> [D, heads * dim]."""
        if q.is_cpu and kernels.available() and self._kernels_take_pools():
            out = torch.ops.liteinfer.paged_decode_attention(
                q, self.k_cache, self.v_cache, block_tables, positions, self.scale, self.sliding_window or 0,
                self.logit_softcap or 0.0, self.k_scales, self.v_scales,
            )
            return out.flatten(1)
        if q.is_cuda and triton_paged_decode_attention is not None and self.k_scales is None:
            out = triton_paged_decode_attention(q, self.k_cache, self.v_cache, block_tables, positions, self.scale,
                                                self.sliding_window or 0, self.logit_softcap or 0.0)
            return out.flatten(1)
        keys, values = self._gather(block_tables, q.dtype)  # [kv_heads, D, keys, dim]
        return self._attend_gathered_decodes(q, keys, values, positions)

    def _attend_gathered_decodes(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """q: [D, heads, dim]; keys, values: [kv_heads, D, L, dim] (key j at position j) -> [D, heads * dim].

        Query heads that share a KV head are stacked into one matrix, so each KV head is read once: GQA becomes
        [kv_heads, D, group, dim] @ [kv_heads, D, dim, L]. Softmax runs in fp32.
        """
        decodes = q.shape[0]
        q = q.view(decodes, self.num_kv_heads, -1, self.head_dim).transpose(0, 1)
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * self.scale  # [kv_heads, D, group, L]
        if self.logit_softcap is not None:
            scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
        scores.masked_fill_(self._hidden_keys(positions, keys.shape[2])[:, None], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # [kv_heads, D, group, dim]
        return out.transpose(0, 1).reshape(decodes, self.num_heads * self.head_dim)

    def _attend_span(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """One sequence's new tokens q: [n, heads, dim] against its keys, values: [kv_heads, L, dim]."""
        num_new, num_keys = q.shape[0], keys.shape[1]
        q = q.transpose(0, 1)  # [heads, n, dim]
        if self.logit_softcap is not None:  # the fused kernel cannot cap scores before the softmax
            group = self.num_heads // self.num_kv_heads
            scores = torch.matmul(q.unflatten(0, (self.num_kv_heads, group)), keys[:, None].transpose(-1, -2))
            scores = torch.tanh(scores.float() * self.scale / self.logit_softcap) * self.logit_softcap
            scores.masked_fill_(self._hidden_keys(positions, num_keys), float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values[:, None]).flatten(0, 1)
        else:
            # A prompt computed from its start with no window is plain causal attention; otherwise an explicit
            # mask (the kernel's is_causal aligns the first query with the first key, not with its position).
            plain_causal = self.sliding_window is None and num_keys == num_new
            mask = None if plain_causal else ~self._hidden_keys(positions, num_keys)
            # A batch dimension of one: on CPU, 3-d inputs fall back to the unfused math path (measured: a
            # 1000-token prompt's layer 49 ms, against 10 ms through the flash kernel that 4-d inputs get).
            out = F.scaled_dot_product_attention(
                q[None], keys[None], values[None], attn_mask=mask, is_causal=plain_causal, scale=self.scale,
                enable_gqa=True,
            )[0]
        return out.transpose(0, 1).reshape(num_new, self.num_heads * self.head_dim)

    def _hidden_keys(self, query_positions: torch.Tensor, num_keys: int) -> torch.Tensor:
        """[..., Lq, num_keys] True where a key lies after the query or outside its sliding window."""
        key_positions = torch.arange(num_keys, device=query_positions.device)
        hidden = key_positions > query_positions[..., None]
        if self.sliding_window is not None:
            hidden |= key_positions <= query_positions[..., None] - self.sliding_window
        return hidden


def _int8_levels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., dim] as integer levels in [-127, 127] (fp32) and each row's scale (its largest |element| / 127)."""
    x = x.float()
    largest = x.abs().amax(-1)
    to_levels = torch.where(largest > 0, 127 / largest, 0.0)
    return torch.round(x * to_levels[..., None]), largest * (1 / 127)
