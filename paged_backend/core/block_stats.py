"""BlockStats: how the pool is used right now (blocks by state, tokens stored, waste, sharing), per layer group."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from paged_backend.core.block_pool import NULL_BLOCK, BlockPool


@dataclass(frozen=True)
class GroupStats:
    """One layer group's share of the pool (its blocks are counted once in the aggregate `BlockStats`)."""

    sliding_window: int | None
    used_blocks: int
    shared_blocks: int
    cached_blocks: int
    tokens_stored: int
    blocks_saved_by_sharing: int


@dataclass(frozen=True)
class BlockStats:
    total_blocks: int  # usable blocks (block 0 excluded)
    used_blocks: int  # held by at least one sequence
    shared_blocks: int  # held by two or more sequences
    cached_blocks: int  # free, but still holding a reusable prefix
    free_blocks: int  # free and empty
    block_size: int
    tokens_stored: int  # distinct token slots filled in used blocks
    logical_tokens: int  # sum of sequence lengths (what a copy per sequence would store)
    blocks_saved_by_sharing: int  # table entries minus used blocks
    cpu_blocks_used: int
    groups: tuple[GroupStats, ...] = ()

    @property
    def waste_pct(self) -> float:
        """Reserved-but-empty slots in used blocks, as % of reserved slots (internal fragmentation)."""
        reserved = self.used_blocks * self.block_size
        return 100.0 * (reserved - self.tokens_stored) / reserved if reserved else 0.0

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0


def collect_block_stats(
    pool: BlockPool,
    sliding_windows: Sequence[int | None],
    resident: Iterable[tuple[list[list[int]], int]],
    cpu_blocks_used: int,
) -> BlockStats:
    """`resident`: (block tables, number of tokens) of every sequence whose blocks are on the GPU."""
    bs, num_groups = pool.block_size, len(sliding_windows)
    fill: dict[int, int] = {}
    entries = [0] * num_groups
    logical = 0
    for tables, n in resident:
        logical += n
        for group, table in enumerate(tables):
            for i, block_id in enumerate(table):
                if block_id != NULL_BLOCK:
                    entries[group] += 1
                    fill[block_id] = max(fill.get(block_id, 0), min(bs, n - i * bs))
    used, shared, cached_free, tokens = ([0] * num_groups for _ in range(4))
    for block in pool.blocks[1:]:  # one pass: stats also feed the KV map's per-step history
        if block.ref_count:
            used[block.group] += 1
            shared[block.group] += block.ref_count > 1
        elif block.hash is not None:
            cached_free[block.group] += 1
    for block_id, count in fill.items():
        tokens[pool.blocks[block_id].group] += count
    groups = [
        GroupStats(window, used[g], shared[g], cached_free[g], tokens[g], entries[g] - used[g])
        for g, window in enumerate(sliding_windows)
    ]
    cached = sum(g.cached_blocks for g in groups)
    return BlockStats(
        total_blocks=len(pool.blocks) - 1,
        used_blocks=pool.num_used,
        shared_blocks=sum(g.shared_blocks for g in groups),
        cached_blocks=cached,
        free_blocks=pool.num_free - cached,
        block_size=bs,
        tokens_stored=sum(fill.values()),
        logical_tokens=logical,
        blocks_saved_by_sharing=sum(entries) - len(fill),
        cpu_blocks_used=cpu_blocks_used,
        groups=tuple(groups),
    )
