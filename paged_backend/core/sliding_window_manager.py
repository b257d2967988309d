"""The block tables of one layer group whose attention sees only the last `window` tokens.

A query at position p reads positions p - window + 1 .. p, so the blocks wholly before the first query a
sequence will still compute are dead: they are freed and their table entries become the null block, keeping the
group's share of a sequence bounded. A prefix hit needs only the blocks inside the window of the first token
left to compute. A long prompt's blocks are taken chunk by chunk (`until` = the end of the step's chunk), never
the whole prompt at once, so with every layer windowed a sequence can grow past the pool's size.
"""

from __future__ import annotations

from paged_backend.core.block_pool import NULL_BLOCK, BlockPool
from paged_backend.core.full_attention_manager import FullAttentionManager


class SlidingWindowManager(FullAttentionManager):
    def __init__(self, pool: BlockPool, group: int, sliding_window: int) -> None:
        super().__init__(pool, group)
        self.sliding_window = sliding_window

    def window_start(self, first_query: int) -> int:
        return max(0, first_query - self.sliding_window + 1) // self.block_size

    def cover(self, num_tokens: int, until: int | None) -> int:
        return num_tokens if until is None else min(until, num_tokens)

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        # The chunk's queries see back window - 1 tokens; +1 for an unaligned start.
        window_blocks = self.pool.blocks_needed(self.sliding_window - 1 + min(chunk, num_tokens)) + 1
        return min(super().peak_blocks(num_tokens, chunk), window_blocks)

    def drop_out_of_window(self, table: list[int], num_dropped: int, first_query: int) -> int:
        stop = self.window_start(first_query)
        if stop <= num_dropped:
            return num_dropped
        for i in range(stop - 1, num_dropped - 1, -1):  # like a free: the later blocks go first
            if table[i] != NULL_BLOCK:
                self.pool.release(self.pool.blocks[table[i]])
                table[i] = NULL_BLOCK
        return stop
