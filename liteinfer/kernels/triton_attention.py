"""Decode attention over the paged KV pool on CUDA, in Triton: the GPU's counterpart of our C++
`paged_decode_attention`, with the same contract for plain pools (kernels/__init__.py).

One program per (sequence, KV head): it holds the query heads that share that KV head, walks the sequence's blocks
through its block table (only those holding keys it may see: up to its position, within the sliding window) and
keeps an online softmax in fp32, so that no block is gathered into a copy and no score row is stored. Each block's
keys and values are read once for the whole group, as a [block_size, dim] tile (a block's rows for one KV head lie
side by side in the pool).

`layers/attention.py` imports it where Triton is installed and calls it for CUDA tensors; CPU-only machines need no
Triton. Its tests (tests/unit/test_paged_attention_kernel.py) run it on CUDA, or without a GPU on CPU tensors
through Triton's interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, positions_ptr, out_ptr,
    scale, softcap, window,
    q_stride_seq, q_stride_head, pool_stride_block, pool_stride_head, pool_stride_row, table_stride,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
):
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    # Inductor passes Python floats to a traced kernel as fp64 (Triton's own launcher, as fp32): in fp64 they would
    # carry the scores and the softmax into fp64.
    scale, softcap = tl.cast(scale, tl.float32), tl.cast(softcap, tl.float32)
    group = tl.arange(0, GROUP_P2)
    dims = tl.arange(0, DIM_P2)
    rows = tl.arange(0, BLOCK_SIZE)
    group_ok, dims_ok = group < GROUP, dims < DIM
    heads = kv_head * GROUP + group
    q_offsets = seq * q_stride_seq + heads[:, None] * q_stride_head + dims[None, :]
    q_mask = group_ok[:, None] & dims_ok[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32)  # [GROUP_P2, DIM_P2]

    position = tl.load(positions_ptr + seq)
    first_key = position * 0
    if WINDOW:
        first_key = tl.maximum(position - window + 1, 0)
    largest = tl.full([GROUP_P2], float("-inf"), tl.float32)  # the online softmax: running max, sum, output
    total = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, DIM_P2], tl.float32)
    tile_offsets = kv_head * pool_stride_head + rows[:, None] * pool_stride_row + dims[None, :]  # within a block
    for index in range(first_key // BLOCK_SIZE, position // BLOCK_SIZE + 1):
        block = tl.load(tables_ptr + seq * table_stride + index)
        offsets = block * pool_stride_block + tile_offsets
        key_positions = index * BLOCK_SIZE + rows
        visible = (key_positions <= position) & (key_positions >= first_key)
        # Slots it may not see are never read: they may hold anything (a freed sequence's rows, or nothing yet).
        tile_mask = visible[:, None] & dims_ok[None, :]
        keys = tl.load(k_ptr + offsets, mask=tile_mask, other=0.0).to(tl.float32)  # [BLOCK_SIZE, DIM_P2]
        scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * scale  # [GROUP_P2, BLOCK_SIZE]
        if SOFTCAP:  # softcap * tanh(scores / softcap), tanh(x) written as 1 - 2 / (e^2x + 1)
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_largest = tl.maximum(largest, tl.max(scores, axis=1))
        weights = tl.exp(scores - new_largest[:, None])
        rescale = tl.exp(largest - new_largest)
        total = total * rescale + tl.sum(weights, axis=1)
        values = tl.load(v_ptr + offsets, mask=tile_mask, other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
        largest = new_largest
    out = acc / total[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, positions: torch.Tensor, scale: float,
                           sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [seqs, heads, dim], pools [blocks, kv_heads, block_size, dim] -> [seqs, heads, dim] in q's dtype."""
    seqs, heads, dim = q.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    _paged_decode_kernel[(seqs, kv_heads)](
        q, k_cache, v_cache, block_tables, positions, out,
        scale, softcap, sliding_window,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=heads // kv_heads, GROUP_P2=triton.next_power_of_2(heads // kv_heads), DIM=dim,
        DIM_P2=triton.next_power_of_2(dim), BLOCK_SIZE=block_size, SOFTCAP=softcap > 0, WINDOW=sliding_window > 0,
    )
    return out
