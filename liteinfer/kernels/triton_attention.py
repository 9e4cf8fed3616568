"""Attention over the paged KV pool on CUDA, in Triton: the GPU's counterparts of our C++ `paged_decode_attention`
and `paged_prefill_attention`, with their contracts for plain pools (kernels/__init__.py).

Decodes: one program per (sequence, KV head). It holds the query heads that share that KV head, walks the
sequence's blocks through its block table (only those holding keys it may see: up to its position, within the
sliding window) and keeps an online softmax in fp32, so that no block is gathered into a copy and no score row is
stored. Each block's keys and values are read once for the whole group, as a [block_size, dim] tile (a block's rows
for one KV head lie side by side in the pool).

Prompts: one program per (span, KV head, tile of up to 64 query rows): a tile is consecutive tokens of one span
times the group's query heads, so that its scores and its weighted values are matrix products (`tl.dot`, which
wants blocks of at least 16 keys); each block the tile's last token may see is read once for all of its rows, each
row masked by its own position. One launch a layer for every span of the step, where SDPA took one per span.

`layers/attention.py` imports them where Triton is installed and calls them for CUDA tensors; CPU-only machines
need no Triton. Their tests (tests/unit/test_paged_attention_kernel.py) run them on CUDA, or without a GPU on CPU
tensors through Triton's interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softcapped(scores, softcap):
    """softcap * tanh(scores / softcap), tanh(x) written as 1 - 2 / (e^2x + 1)."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))


@triton.jit
def _online_softmax_step(scores, largest, total):
    """One block's scores [rows, keys] into a running softmax: its weights, the factor that rescales what was summed
    before, and the new running sum and maximum of each row."""
    new_largest = tl.maximum(largest, tl.max(scores, axis=1))
    weights = tl.exp(scores - new_largest[:, None])
    rescale = tl.exp(largest - new_largest)
    return weights, rescale, total * rescale + tl.sum(weights, axis=1), new_largest


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
        if SOFTCAP:
            scores = _softcapped(scores, softcap)
        scores = tl.where(visible[None, :], scores, float("-inf"))
        weights, rescale, total, largest = _online_softmax_step(scores, largest, total)
        values = tl.load(v_ptr + offsets, mask=tile_mask, other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
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


# Query rows a prompt program holds: tokens times the group's heads (padded to a power of two).
PREFILL_TILE_ROWS = 64


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, starts_ptr, positions_ptr, out_ptr,
    scale, softcap, window,
    q_stride_token, q_stride_head, pool_stride_block, pool_stride_head, pool_stride_row, table_stride,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, TOKENS: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):
    span, kv_head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    span_end = tl.load(starts_ptr + span + 1)
    first_token = tl.load(starts_ptr + span) + tile * TOKENS
    if first_token >= span_end:  # the grid covers the longest span
        return
    scale, softcap = tl.cast(scale, tl.float32), tl.cast(softcap, tl.float32)  # as the decode kernel's
    # Row r of the tile: token first_token + r // GROUP_P2, query head r % GROUP_P2 of the group.
    rows = tl.arange(0, TOKENS * GROUP_P2)
    tokens = first_token + rows // GROUP_P2
    heads = kv_head * GROUP + rows % GROUP_P2
    dims = tl.arange(0, DIM_P2)
    keys_in_block = tl.arange(0, BLOCK_SIZE)
    token_ok, dims_ok = tokens < span_end, dims < DIM
    q_offsets = tokens[:, None] * q_stride_token + heads[:, None] * q_stride_head + dims[None, :]
    q_mask = (token_ok & (rows % GROUP_P2 < GROUP))[:, None] & dims_ok[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32)  # [rows, DIM_P2]
    positions = tl.load(positions_ptr + tokens, mask=token_ok, other=0)

    # The keys any row may see: up to the last token's position, from the first token's window on.
    last_key = tl.load(positions_ptr + tl.minimum(first_token + TOKENS, span_end) - 1)
    first_key = last_key * 0
    if WINDOW:
        first_key = tl.maximum(tl.load(positions_ptr + first_token) - window + 1, 0)
    # A finite start: a row may see no key of a block (its window begins later), and -inf - -inf would be NaN.
    largest = tl.full([TOKENS * GROUP_P2], -1.0e30, tl.float32)
    total = tl.zeros([TOKENS * GROUP_P2], tl.float32)
    acc = tl.zeros([TOKENS * GROUP_P2, DIM_P2], tl.float32)
    tile_offsets = kv_head * pool_stride_head + keys_in_block[:, None] * pool_stride_row + dims[None, :]
    for index in range(first_key // BLOCK_SIZE, last_key // BLOCK_SIZE + 1):
        block = tl.load(tables_ptr + span * table_stride + index)
        offsets = block * pool_stride_block + tile_offsets
        key_positions = index * BLOCK_SIZE + keys_in_block
        # Slots no row may see are never read: they may hold anything.
        in_range = (key_positions <= last_key) & (key_positions >= first_key)
        tile_mask = in_range[:, None] & dims_ok[None, :]
        keys = tl.load(k_ptr + offsets, mask=tile_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale  # [rows, BLOCK_SIZE]
        if SOFTCAP:
            scores = _softcapped(scores, softcap)
        visible = in_range[None, :] & (key_positions[None, :] <= positions[:, None])
        if WINDOW:
            visible &= key_positions[None, :] > positions[:, None] - window
        scores = tl.where(visible, scores, float("-inf"))
        weights, rescale, total, largest = _online_softmax_step(scores, largest, total)
        values = tl.load(v_ptr + offsets, mask=tile_mask, other=0.0).to(tl.float32)
        # The weights rounded to the pool's dtype, as PyTorch's flash attention and our C++ prompt kernel round them.
        weights = weights.to(v_ptr.dtype.element_ty).to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(weights, values, input_precision=PRECISION)
    out = acc / total[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, span_starts: torch.Tensor, positions: torch.Tensor,
                            scale: float, longest_span: int, sliding_window: int = 0,
                            softcap: float = 0.0) -> torch.Tensor:
    """q [tokens, heads, dim], span s being rows span_starts[s]..span_starts[s + 1], block_tables [spans, width],
    pools [blocks, kv_heads, block_size >= 16, dim] -> [tokens, heads, dim] in q's dtype. `longest_span` (tokens)
    sizes the grid; the host knows it, and reading it from span_starts would wait for the device."""
    _, heads, dim = q.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group_p2 = triton.next_power_of_2(heads // kv_heads)
    tile_tokens = max(1, PREFILL_TILE_ROWS // group_p2)
    q = q.contiguous()
    out = torch.empty_like(q)
    _paged_prefill_kernel[(len(block_tables), kv_heads, triton.cdiv(longest_span, tile_tokens))](
        q, k_cache, v_cache, block_tables, span_starts, positions, out,
        scale, softcap, sliding_window,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=heads // kv_heads, GROUP_P2=group_p2, TOKENS=tile_tokens, DIM=dim, DIM_P2=triton.next_power_of_2(dim),
        BLOCK_SIZE=block_size, SOFTCAP=softcap > 0, WINDOW=sliding_window > 0,
        # bf16 and fp16 hold no more bits than tf32 multiplies: in tf32 their products are exact (the interpreter,
        # which cannot multiply bf16, then runs fp32); fp32 products in fp32.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
