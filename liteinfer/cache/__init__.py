"""The paged KV cache: one pre-allocated pool of fixed-size blocks and the book-keeping of who holds which.

Contract: `KVCache` owns the K/V tensors (`[layers, blocks, kv_heads, block_size, head_dim]`, allocated once,
written in place, never copied whole; with `kv_cache_dtype="int8"` bytes plus each row's scale, laid out as
liteinfer/kernels/__init__.py gives). `BlockManager` owns block ownership: a free list and a reference count per
block; a sequence's block table lists the blocks holding its tokens in order, and blocks may be shared by several
tables (forked samples) — a block returns to the free list only when its last holder frees it. Neither knows about
requests, sampling or scheduling policy; the scheduler decides who gets blocks, this package only grants or
refuses them.
"""

from liteinfer.cache.block_manager import BlockManager
from liteinfer.cache.kv_cache import KVCache

__all__ = ["BlockManager", "KVCache"]
