"""Block allocation with reference counts, and prefix caching over full blocks.

With prefix caching on, a block that holds `block_size` computed tokens is registered under a chained hash of
(the previous block's hash, its token ids), so its hash names the whole prefix up to and including it. A later
sequence whose prompt starts with the same tokens takes a reference to those blocks instead of computing them
again. A freed block keeps its contents and hash: it waits in the free list, least recently freed first, and is
only evicted (its hash forgotten) when it is handed out as a fresh block.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Free blocks in eviction order (least recently freed first); an OrderedDict so that a cached block can
        # be taken out of the middle when a prefix hit revives it.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached_blocks: dict[int, int] = {}  # hash -> block holding that prefix

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow `block_table` in place with fresh blocks until it holds `num_tokens` tokens.

        Returns False, leaving the table untouched, if there are not enough free blocks.
        """
        needed = self.blocks_for(num_tokens) - len(block_table)
        if needed > len(self.free_blocks):
            return False
        for _ in range(needed):
            block, _ = self.free_blocks.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            block_table.append(block)
        return True

    def share(self, blocks: list[int]) -> list[int]:
        """A new table holding the same blocks (one more reference each), for a sample forked off a prompt."""
        for block in blocks:
            if self.ref_counts[block] < 1:
                raise RuntimeError(f"cannot share block {block}: it is free")
            self.ref_counts[block] += 1
        return list(blocks)

    def free(self, block_table: list[int]) -> None:
        """Drop the table's reference to each of its blocks and empty it.

        The tail is freed first, so that it is evicted first: a prompt's later blocks are less likely to be
        shared than its beginning.
        """
        for block in reversed(block_table):
            if self.ref_counts[block] < 1:
                raise RuntimeError(f"double free of block {block}")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        block_table.clear()

    # Prefix caching ---------------------------------------------------------------------------------------------

    def hash_blocks(self, token_ids: list[int], num_blocks: int, hashes: list[int]) -> None:
        """Extend `hashes` (a sequence's chain, kept by its owner) to cover its first `num_blocks` full blocks."""
        size = self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else None
            hashes.append(hash((parent, tuple(token_ids[i * size : (i + 1) * size]))))

    def match_prefix(self, token_ids: list[int], hashes: list[int]) -> list[int]:
        """Blocks holding the longest cached prefix of `token_ids` in full blocks, each with a reference taken.

        The block of the last token is never matched: its logits must be computed to sample the next token.
        """
        if not self.enable_prefix_caching:
            return []
        size = self.block_size
        num_blocks = (len(token_ids) - 1) // size
        self.hash_blocks(token_ids, num_blocks, hashes)
        matched: list[int] = []
        for i in range(num_blocks):
            block = self.cached_blocks.get(hashes[i])
            # A hash names a prefix only probably; the tokens say for sure.
            if block is None or self.block_tokens[block] != tuple(token_ids[i * size : (i + 1) * size]):
                break
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
            matched.append(block)
        return matched

    def cache_blocks(self, block_table: list[int], token_ids: list[int], hashes: list[int], start: int, end: int):
        """Register the blocks that became full while tokens [start, end) were computed."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        self.hash_blocks(token_ids, end // size, hashes)
        for i in range(start // size, end // size):
            block = block_table[i]
            if self.block_hash[block] is None:
                self.block_hash[block] = hashes[i]
                self.block_tokens[block] = tuple(token_ids[i * size : (i + 1) * size])
                # Two sequences may compute the same prefix in one step; the first block registered serves.
                self.cached_blocks.setdefault(hashes[i], block)

    def _evict(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            if self.cached_blocks.get(block_hash) == block:
                del self.cached_blocks[block_hash]
            self.block_hash[block] = None
            self.block_tokens[block] = None
