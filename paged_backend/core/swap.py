"""SwapSpace: the CPU blocks that hold preempted sequences' K/V while they are swapped out.

Sequences swapped together (one request's forks) keep sharing: a block several of them hold is copied once and
gets one CPU block with as many holders. While a sequence is swapped out its tables hold CPU block ids, and a
dropped (out-of-window) entry is CPU_NULL_BLOCK. The cache (`PagedKVCache`) performs the copies returned here.
"""

from __future__ import annotations

from collections.abc import Iterable

from paged_backend.core.block_pool import NULL_BLOCK, BlockPool
from paged_backend.errors import OutOfBlocks

CPU_NULL_BLOCK = -1  # a dropped (out-of-window) table entry while the sequence is swapped out


def held_blocks(table: list[int], on_cpu: bool) -> list[int]:
    """The table's real entries: dropped out-of-window entries are the null block (CPU_NULL_BLOCK on CPU)."""
    null = CPU_NULL_BLOCK if on_cpu else NULL_BLOCK
    return [block_id for block_id in table if block_id != null]


def distinct_blocks(tables: Iterable[tuple[list[int], bool]]) -> list[int]:
    """Each block the (table, on_cpu) pairs hold, once, in first-seen order."""
    return list(dict.fromkeys(block_id for table, on_cpu in tables for block_id in held_blocks(table, on_cpu)))


class SwapSpace:
    def __init__(self, num_cpu_blocks: int) -> None:
        self.free = list(range(num_cpu_blocks - 1, -1, -1))
        self.ref_counts = [0] * num_cpu_blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return len(self.ref_counts) - len(self.free)

    def swap_out(self, pool: BlockPool, tables: list[list[int]]) -> list[tuple[int, int]]:
        """Point GPU-resident `tables` at CPU blocks (in place) and release their GPU blocks.
        Returns the (gpu_block, cpu_block) copies to perform before the GPU blocks are reused."""
        gpu_blocks = distinct_blocks((table, False) for table in tables)
        if len(gpu_blocks) > self.num_free:
            raise OutOfBlocks(
                f"swapping out needs {len(gpu_blocks)} CPU blocks but {self.num_free} are free; raise --swap-space"
            )
        mapping = {gpu: self.free.pop() for gpu in gpu_blocks}
        copies = list(mapping.items())
        mapping[NULL_BLOCK] = CPU_NULL_BLOCK
        for table in tables:
            pool.release_tail_first(table)
            table[:] = [mapping[gpu] for gpu in table]
            for cpu in held_blocks(table, on_cpu=True):
                self.ref_counts[cpu] += 1
        return copies

    def swap_in(self, pool: BlockPool, tables: list[tuple[int, list[int]]]) -> list[tuple[int, int]]:
        """Point swapped-out (group, table) pairs back at fresh GPU blocks of their groups (in place).
        Returns the (cpu_block, gpu_block) copies to perform."""
        cpu_blocks = distinct_blocks((table, True) for _, table in tables)
        if len(cpu_blocks) > pool.num_free:
            raise OutOfBlocks(f"swapping in needs {len(cpu_blocks)} free KV blocks, {pool.num_free} free")
        group_of = {cpu: group for group, table in tables for cpu in table}
        mapping = {cpu: pool.take(group_of[cpu]) for cpu in cpu_blocks}
        for block in mapping.values():
            block.ref_count = 0  # one holder per table entry, counted below
        for _, table in tables:
            for cpu in held_blocks(table, on_cpu=True):
                mapping[cpu].ref_count += 1
                self.release(cpu)
            table[:] = [NULL_BLOCK if cpu == CPU_NULL_BLOCK else mapping[cpu].block_id for cpu in table]
        return [(cpu, block.block_id) for cpu, block in mapping.items()]

    def release(self, cpu_block: int) -> None:
        self.ref_counts[cpu_block] -= 1
        if self.ref_counts[cpu_block] == 0:
            self.free.append(cpu_block)
