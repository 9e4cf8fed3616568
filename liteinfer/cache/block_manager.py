"""Block allocation with reference counts."""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow `block_table` in place until it holds `num_tokens` tokens; False (table untouched) if it can't."""
        needed = self.blocks_for(num_tokens) - len(block_table)
        if needed > len(self.free_blocks):
            return False
        for _ in range(needed):
            block = self.free_blocks.popleft()
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
        """Drop the table's reference to each of its blocks and empty it."""
        for block in reversed(block_table):
            if self.ref_counts[block] < 1:
                raise RuntimeError(f"double free of block {block}")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        block_table.clear()
