"""The block tables of one layer group of full-attention layers, drawn from the shared `BlockPool`.

A table is a list of block ids: entry i holds tokens [i * block_size, (i + 1) * block_size) of its sequence.
Full attention reads every earlier token, so a table keeps all its blocks for the sequence's life. This class
sizes and grows tables, takes prefix hits, copies a shared partially filled block before a write and publishes
full blocks to the prefix cache. `SlidingWindowManager` changes only which blocks a group must
hold; every table operation here serves both.
"""

from __future__ import annotations

from paged_backend.core.block_pool import NULL_BLOCK, Block, BlockPool


class FullAttentionManager:
    sliding_window: int | None = None

    def __init__(self, pool: BlockPool, group: int) -> None:
        self.pool = pool
        self.group = group
        self.block_size = pool.block_size

    # ------------------------------------------------ what the group must hold
    def window_start(self, first_query: int) -> int:
        """First block index a query at `first_query` (or later) can still see."""
        return 0

    def cover(self, num_tokens: int, until: int | None) -> int:
        """Leading tokens whose slots the group holds, when a step computes the positions before `until`."""
        return num_tokens

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """Most blocks one sequence of `num_tokens` holds at once, computed `chunk` tokens a step."""
        return self.pool.blocks_needed(num_tokens)

    def drop_out_of_window(self, table: list[int], num_dropped: int, first_query: int) -> int:
        """Free the blocks no query at `first_query` or later can see; returns the new count of dropped entries."""
        return num_dropped

    # ----------------------------------------------------------- prefix hits
    def hit_blocks(self, found: list[Block | None], hit: int) -> list[Block | None] | None:
        """This group's blocks for a prefix hit of `hit` blocks (None where it needs none), or None when a block
        it needs is not cached."""
        start = self.window_start(hit * self.block_size)
        if any(block is None for block in found[start:hit]):
            return None
        return [None] * start + found[start:hit]

    # ------------------------------------------------------------ allocation
    def _fresh_blocks(self, num_tokens: int, num_hits: int, chunk: int | None) -> int:
        """Blocks a new sequence takes from the pool past its hits, up to what the group covers."""
        until = None if chunk is None else num_hits * self.block_size + chunk
        return self.pool.blocks_needed(self.cover(num_tokens, until)) - num_hits

    def blocks_to_allocate(self, num_tokens: int, hits: list[Block | None], chunk: int | None) -> int:
        idle_hits = sum(1 for block in hits if block is not None and block.ref_count == 0)  # they leave the queue
        return self._fresh_blocks(num_tokens, len(hits), chunk) + idle_hits

    def acquire_hits(self, hits: list[Block | None]) -> list[int]:
        """The table of a new sequence's cached prefix: each hit gains a holder."""
        for block in hits:
            if block is not None:
                self.pool.acquire(block)
        return [NULL_BLOCK if block is None else block.block_id for block in hits]

    def grow_new(self, table: list[int], num_tokens: int, chunk: int | None) -> None:
        """Extend a new sequence's table of hits with fresh blocks for the tokens the group covers."""
        fresh = self._fresh_blocks(num_tokens, len(table), chunk)
        table.extend(self.pool.take_ids(self.group, fresh))

    # ---------------------------------------------------------------- append
    def _partial_index(self, table: list[int], num_tokens: int) -> int | None:
        """Index of the partially filled block the next token lands in; None at a block boundary."""
        index = num_tokens // self.block_size
        return index if num_tokens % self.block_size and index < len(table) else None

    def blocks_to_append(self, table: list[int], num_tokens: int, num_new: int, until: int | None, copy: bool) -> int:
        """Free blocks `append` takes; `copy`: whether a shared last block would be copied (not while on CPU)."""
        need = max(0, self.pool.blocks_needed(self.cover(num_tokens + num_new, until)) - len(table))
        index = self._partial_index(table, num_tokens)
        # a swapped-out table holds CPU block ids: nothing of the pool's to look at, nothing to copy
        shared = copy and index is not None and self.pool.blocks[table[index]].ref_count > 1
        return need + (num_new > 0 and shared)

    def append(self, table: list[int], num_tokens: int, end: int, until: int | None) -> list[tuple[int, int]]:
        """Make room for positions `num_tokens`..`end`-1 (and what `until` covers). Returns the (src, dst) copy
        of a shared partially filled block the new tokens would write into."""
        copies: list[tuple[int, int]] = []
        index = self._partial_index(table, num_tokens)
        if end > num_tokens and index is not None:
            last = self.pool.blocks[table[index]]
            if last.ref_count > 1:
                fresh = self.pool.take(self.group)
                last.ref_count -= 1
                table[index] = fresh.block_id
                copies.append((last.block_id, fresh.block_id))
            elif last.hash is not None:
                self.pool.unhash(last)  # about to be overwritten past its cached contents
        grow = self.pool.blocks_needed(self.cover(end, until)) - len(table)
        table.extend(self.pool.take_ids(self.group, grow))
        return copies

    # --------------------------------------------------------------- publish
    def publish(self, table: list[int], first: int, entries: list[tuple[int | None, tuple[int, ...], int]]) -> None:
        """Publish the blocks from index `first` on: `entries` holds each one's (parent hash, tokens, hash)."""
        for index, (parent, tokens, key) in enumerate(entries, first):
            if index < len(table) and table[index] != NULL_BLOCK:
                self.pool.publish(self.pool.blocks[table[index]], key, parent, tokens)
