"""Batch rows as BlockManager sequences: one sequence per row, forked to share blocks instead of copying KV.

Beams, `num_return_sequences` and repeated prompts all become forks: a forked row holds its parent's blocks
(copy-on-write), so reordering beams permutes block tables and repeated prompts are stored once.
"""

from __future__ import annotations

from paged_backend.core.block_manager import NULL_BLOCK, BlockManager
from paged_backend.core.kv_cache import PagedKVCache


def _placeholder_tokens(n: int) -> list[int]:
    # Prefix caching is off, so the BlockManager only needs the token count.
    return [0] * n


class RowBlocks:
    """The BlockManager sequence of each batch row, and the block operations rows need."""

    def __init__(self, block_manager: BlockManager, kv_cache: PagedKVCache) -> None:
        self.block_manager, self.kv_cache = block_manager, kv_cache
        self.seqs: list[int] = []  # BlockManager sequence id of each batch row
        self._last_seq_id = 0

    def __len__(self) -> int:
        return len(self.seqs)

    def open(self, batch: int) -> None:
        """`batch` empty rows; they take blocks as their tokens arrive."""
        self.seqs = [self._new_seq_id() for _ in range(batch)]

    def select(self, picks: list[int]) -> None:
        """Row i continues row `picks[i]` (beam reordering): block tables are forked, no KV is copied."""
        if picks == list(range(len(self.seqs))):
            return
        seqs = [self._fork(self.seqs[i]) for i in picks]
        self.free()
        self.seqs = seqs

    def repeat_interleave(self, repeats: int) -> None:
        """Row i becomes rows i*repeats .. i*repeats+repeats-1, all sharing its blocks."""
        self.seqs = [copy for seq in self.seqs for copy in [seq] + [self._fork(seq) for _ in range(repeats - 1)]]

    def free(self) -> None:
        """Give every row's blocks back; no rows are left."""
        for seq in self.seqs:
            if self.block_manager.has(seq):
                self.block_manager.free(seq)
        self.seqs = []

    def num_stored(self, row: int) -> int:
        seq = self.seqs[row]
        return self.block_manager.num_tokens(seq) if self.block_manager.has(seq) else 0

    def block_tables(self) -> list[tuple[int, ...]]:
        """Each row's block tables (one per layer group), comparable across rows."""
        bm = self.block_manager
        return [tuple(map(tuple, bm.block_tables(seq))) if bm.has(seq) else () for seq in self.seqs]

    def reserve(self, counts: list[int], followers: dict[int, int]) -> None:
        """Slots for each row's `counts` new tokens; `followers` share their leader's blocks instead.

        Raises the BlockManager's `OutOfBlocks` when the pool is full, with some rows grown and others not.
        """
        copies: list[tuple[int, int]] = []
        for row, (seq, count) in enumerate(zip(self.seqs, counts, strict=True)):
            if row not in followers:
                copies += self._grow(seq, count)
        for row, leader in followers.items():
            if self.block_manager.has(self.seqs[row]):
                self.block_manager.free(self.seqs[row])  # it held the leader's blocks; it now follows its growth
            if self.block_manager.has(self.seqs[leader]):
                self.block_manager.fork(self.seqs[leader], self.seqs[row])
        self.kv_cache.copy_blocks(copies)

    def unshare(self, row: int, leader: int) -> None:
        """`row` stops following `leader`: it gets its own blocks, holding a copy of the leader's KV so far."""
        bm, seq, lead = self.block_manager, self.seqs[row], self.seqs[leader]
        if not bm.has(lead):
            return
        bm.free(seq)
        bm.allocate(seq, _placeholder_tokens(bm.num_tokens(lead)))
        # Earlier layers were verified equal, so the leader's blocks are this row's KV up to here.
        pairs = [
            (src, dst)
            for lead_table, own_table in zip(bm.block_tables(lead), bm.block_tables(seq), strict=True)
            for src, dst in zip(lead_table, own_table, strict=True)
            if src != NULL_BLOCK
        ]
        self.kv_cache.copy_blocks(pairs)

    def truncate(self, stored: list[int]) -> None:
        """Row i keeps its first `stored[i]` tokens."""
        for seq, count in zip(self.seqs, stored, strict=True):
            if self.block_manager.has(seq):
                self.block_manager.truncate(seq, count)

    def _new_seq_id(self) -> int:
        self._last_seq_id += 1
        return self._last_seq_id

    def _fork(self, seq: int) -> int:
        child = self._new_seq_id()
        if self.block_manager.has(seq):
            self.block_manager.fork(seq, child)
        return child

    def _grow(self, seq: int, num_tokens: int) -> list[tuple[int, int]]:
        """Reserve slots for `num_tokens` more tokens; returns the copy-on-write block copies to do."""
        if num_tokens == 0:
            return []
        if not self.block_manager.has(seq):
            self.block_manager.allocate(seq, _placeholder_tokens(num_tokens))
            return []
        return self.block_manager.append_slots(seq, _placeholder_tokens(num_tokens))
