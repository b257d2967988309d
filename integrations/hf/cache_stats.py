"""What a PagedCache holds right now, in blocks and bytes."""

from __future__ import annotations

from dataclasses import dataclass

from paged_backend.core.block_manager import BlockStats


@dataclass(frozen=True)
class CacheStats:
    """Block counts from the BlockManager plus their size in bytes.

    >>> s = CacheStats(BlockStats(9, 2, 1, 0, 7, 16, 20, 36, 1, 0), bytes_per_block=1024, peak_used_blocks=3)
    >>> s.used_bytes, s.saved_bytes, round(s.waste_pct, 1)
    (2048, 1024, 37.5)
    """

    blocks: BlockStats
    bytes_per_block: int
    peak_used_blocks: int

    def __getattr__(self, name: str):
        """Every `BlockStats` count reads through (used_blocks, shared_blocks, free_blocks, total_blocks, waste_pct,
        blocks_saved_by_sharing, groups, ...)."""
        if name == "blocks":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.blocks, name)

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.bytes_per_block

    @property
    def saved_bytes(self) -> int:
        """Bytes a cache that copies the KV per row would need on top of what is used now."""
        return self.blocks_saved_by_sharing * self.bytes_per_block

    @property
    def pool_bytes(self) -> int:
        return (self.total_blocks + 1) * self.bytes_per_block  # + the reserved null block

    @property
    def peak_used_bytes(self) -> int:
        return self.peak_used_blocks * self.bytes_per_block

    def __str__(self) -> str:
        mib = 2**20
        return (
            f"blocks used {self.used_blocks} (shared {self.shared_blocks}) / free {self.free_blocks} "
            f"of {self.total_blocks}; {self.used_bytes / mib:.2f} MiB used of {self.pool_bytes / mib:.2f} MiB, "
            f"peak {self.peak_used_bytes / mib:.2f} MiB; waste {self.waste_pct:.1f}%; sharing saved "
            f"{self.blocks_saved_by_sharing} blocks ({self.saved_bytes / mib:.2f} MiB)"
        )
