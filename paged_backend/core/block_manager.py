"""BlockManager: the paged KV pool's bookkeeping for sequences, pure Python (no tensors).

A thin facade: it keeps each sequence's block tables (one per layer group), tokens and committed prefix hashes,
and leaves the rules to the parts below it:

- `block_pool`: every block, refcounts, the O(1) free queue and the prefix cache with lazy LRU eviction;
- one manager per layer group, all drawing from the one pool: `full_attention_manager` and
  `sliding_window_manager` (a windowed group frees what its window no longer sees);
- `swap`: the CPU blocks of sequences preempted by swapping;
- `block_stats`: what `stats()` reports.

The cache (`PagedKVCache`) does what this class decides: copy-on-write pairs and swap maps come back from the
calls that need them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from paged_backend.core.block_pool import NULL_BLOCK, Block, BlockPool, default_block_hash
from paged_backend.core.block_stats import BlockStats, GroupStats, collect_block_stats
from paged_backend.core.full_attention_manager import FullAttentionManager
from paged_backend.core.sliding_window_manager import SlidingWindowManager
from paged_backend.core.swap import CPU_NULL_BLOCK, SwapSpace, distinct_blocks, held_blocks
from paged_backend.errors import InvalidRequest, OutOfBlocks

__all__ = ["CPU_NULL_BLOCK", "NULL_BLOCK", "BlockManager", "BlockStats", "GroupStats", "SequenceBlocks"]


def slot_of(table: Sequence[int], position: int, block_size: int) -> int:
    """The pool slot of token `position` of a sequence whose blocks are `table`."""
    return table[position // block_size] * block_size + position % block_size


@dataclass
class SequenceBlocks:
    """Per-sequence state: one block table per group, the token ids it stored, its committed block hashes."""

    block_tables: list[list[int]]
    token_ids: list[int]
    extra_keys: Hashable = None
    block_hashes: list[int] = field(default_factory=list)
    on_cpu: bool = False
    num_dropped: list[int] = field(default_factory=list)  # per group: leading entries already out of window


class BlockManager:
    """Allocates, shares and frees KV blocks for sequences identified by any hashable id.

    `sliding_windows` has one entry per layer group (None: full attention); the default is one full group.

    >>> bm = BlockManager(num_blocks=8, block_size=4)
    >>> bm.allocate("a", [1, 2, 3, 4, 5])
    0
    >>> bm.block_table("a")
    [1, 2]
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
        watermark: float = 0.0,
        num_cpu_blocks: int = 0,
        hash_fn=default_block_hash,
        sliding_windows: Sequence[int | None] = (None,),
    ) -> None:
        if block_size < 1 or block_size & (block_size - 1) or block_size > 256:
            raise InvalidRequest(f"block_size must be a power of two in 1..256, got {block_size}")
        if num_blocks < 2:
            raise InvalidRequest(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        if not sliding_windows or any(w is not None and w < 1 for w in sliding_windows):
            raise InvalidRequest(f"sliding_windows needs one entry per group, None or >= 1, got {sliding_windows}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks  # the swap space (0: preemption recomputes)
        self.sliding_windows = tuple(sliding_windows)
        self.num_groups = len(self.sliding_windows)
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * (num_blocks - 1))
        self.pool = BlockPool(num_blocks, block_size, self.num_groups, hash_fn)
        self.group_managers = [
            FullAttentionManager(self.pool, g) if w is None else SlidingWindowManager(self.pool, g, w)
            for g, w in enumerate(self.sliding_windows)
        ]
        self.swap = SwapSpace(num_cpu_blocks)
        self.seqs: dict[Hashable, SequenceBlocks] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found cached

    # ----------------------------------------------------------------- queries
    @property
    def blocks(self) -> list[Block]:
        """Every block, indexed by id (block 0 is the null block)."""
        return self.pool.blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty or evictable cached)."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.pool.num_used

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self.seqs

    def block_table(self, seq_id: Hashable, group: int = 0) -> list[int]:
        return self.seqs[seq_id].block_tables[group]

    def block_tables(self, seq_id: Hashable) -> list[list[int]]:
        """One table per group; a windowed group's out-of-window entries are the null block 0."""
        return self.seqs[seq_id].block_tables

    def num_blocks_held(self, seq_id: Hashable) -> list[int]:
        """Per group: blocks the sequence's table points at (null entries excluded; CPU blocks when swapped)."""
        seq = self.seqs[seq_id]
        return [len(held_blocks(table, seq.on_cpu)) for table in seq.block_tables]

    def num_tokens(self, seq_id: Hashable) -> int:
        return len(self.seqs[seq_id].token_ids)

    def slot_mapping(self, seq_id: Hashable, start: int, end: int, group: int = 0) -> list[int]:
        """Physical slots of positions [start, end) of `seq_id` in `group`'s blocks."""
        table = self.seqs[seq_id].block_tables[group]
        return [slot_of(table, position, self.block_size) for position in range(start, end)]

    def slot(self, seq_id: Hashable, position: int, group: int = 0) -> int:
        return self.slot_mapping(seq_id, position, position + 1, group)[0]

    def window_start(self, group: int, first_query: int) -> int:
        """First block index of `group` a query at `first_query` (or later) can still see."""
        return self.group_managers[group].window_start(first_query)

    def peak_blocks_per_sequence(self, num_tokens: int, chunk: int) -> int:
        """Most blocks a sequence of `num_tokens` holds at once (every group) when it computes at most `chunk`
        tokens per step: full groups hold every block; a windowed group its window plus one step's chunk."""
        return sum(manager.peak_blocks(num_tokens, chunk) for manager in self.group_managers)

    @property
    def usable_blocks(self) -> int:
        """Blocks one sequence may hold on its own: all but the null block and the admission watermark."""
        return self.num_blocks - 1 - self.watermark_blocks

    def fits_alone(self, num_tokens: int, chunk: int) -> bool:
        """Whether a sequence of `num_tokens`, computed `chunk` tokens a step, fits the pool with nothing else."""
        return self.peak_blocks_per_sequence(num_tokens, chunk) <= self.usable_blocks

    # -------------------------------------------------------------- allocation
    def _find_cached_prefix(
        self, token_ids: Sequence[int], extra_keys: Hashable, lookup: bool
    ) -> tuple[list[list[Block | None]], list[int]]:
        """Per group, the cached blocks of the longest prefix every group can serve (None where a windowed group
        needs nothing), and that prefix's hashes. The last token is always left to recompute."""
        managers = self.group_managers
        if not self.enable_prefix_caching or not lookup:
            return [[] for _ in managers], []
        full_groups = [manager.group for manager in managers if manager.sliding_window is None]
        hashes: list[int] = []
        found: list[list[Block | None]] = [[] for _ in managers]
        limit = (len(token_ids) - 1) // self.block_size
        for parent, tokens, key in self.pool.block_hashes(token_ids, extra_keys, 0, limit, None):
            row = [self.pool.lookup(manager.group, key, parent, tokens) for manager in managers]
            if any(row[g] is None for g in full_groups):
                break  # full-attention groups need every leading block
            hashes.append(key)
            for group, block in enumerate(row):
                found[group].append(block)
        hit = len(hashes)
        while True:  # windowed groups only need the blocks a query right after the hit can see
            hits = [manager.hit_blocks(found[manager.group], hit) for manager in managers]
            if all(group_hits is not None for group_hits in hits):
                return hits, hashes[:hit]
            hit -= 1

    def _blocks_to_take(self, num_tokens: int, hits: list[list[Block | None]], chunk: int | None) -> int:
        return sum(
            manager.blocks_to_allocate(num_tokens, hits[manager.group], chunk) for manager in self.group_managers
        )

    def blocks_to_allocate(
        self, token_ids: Sequence[int], extra_keys: Hashable = None, *, lookup: bool = True, chunk: int | None = None
    ) -> tuple[int, set[int]]:
        """What `allocate` would take from the free pool now, and the ids of the prefix-cache blocks it would reuse
        (the scheduler weighs them when it frees room for a newcomer)."""
        hits, _ = self._find_cached_prefix(token_ids, extra_keys, lookup)
        reused = {block.block_id for group in hits for block in group if block is not None}
        return self._blocks_to_take(len(token_ids), hits, chunk), reused

    def can_allocate(
        self, token_ids: Sequence[int], extra_keys: Hashable = None, *, lookup: bool = True, chunk: int | None = None
    ) -> bool:
        """Whether `allocate` would succeed now while keeping the watermark free."""
        need, _ = self.blocks_to_allocate(token_ids, extra_keys, lookup=lookup, chunk=chunk)
        return need <= self.num_free_blocks - self.watermark_blocks

    def allocate(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        extra_keys: Hashable = None,
        *,
        lookup: bool = True,
        chunk: int | None = None,
    ) -> int:
        """Give `seq_id` blocks for `token_ids`. Returns how many leading tokens are already cached.

        `lookup=False` skips the prefix cache (every token is computed) but still publishes the blocks on commit.
        `chunk` (at least 1): windowed groups take blocks only for the cached prefix plus the first `chunk`
        tokens computed; `append_slots(..., until=)` extends them as later chunks are scheduled.
        """
        if seq_id in self.seqs:
            raise InvalidRequest(f"sequence {seq_id!r} already has blocks; free it first")
        if not token_ids:
            raise InvalidRequest("cannot allocate an empty sequence; give at least one token")
        hits, hashes = self._find_cached_prefix(token_ids, extra_keys, lookup)
        need = self._blocks_to_take(len(token_ids), hits, chunk)
        if need > self.num_free_blocks:
            raise OutOfBlocks(
                f"{need} KV blocks needed for a {len(token_ids)}-token sequence but only "
                f"{self.num_free_blocks} are free; raise num_blocks / the KV memory budget or shorten the prompt"
            )
        # Every group holds its hits before any group takes fresh blocks, so no fresh take evicts a hit.
        tables = [manager.acquire_hits(hits[manager.group]) for manager in self.group_managers]
        for manager in self.group_managers:
            manager.grow_new(tables[manager.group], len(token_ids), chunk)
        cached = len(hashes) * self.block_size
        self.seqs[seq_id] = SequenceBlocks(
            block_tables=tables,
            token_ids=list(token_ids),
            extra_keys=extra_keys,
            block_hashes=hashes,
            num_dropped=[manager.window_start(cached) for manager in self.group_managers],
        )
        if self.enable_prefix_caching:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += cached
        return cached

    def blocks_to_append(self, seq_id: Hashable, num_tokens: int = 1, until: int | None = None) -> int:
        """Free blocks `append_slots(seq_id, num_tokens tokens, until)` takes."""
        seq = self.seqs[seq_id]
        n, copy = len(seq.token_ids), not seq.on_cpu
        tables = self._by_group(seq)
        return sum(manager.blocks_to_append(table, n, num_tokens, until, copy) for manager, table in tables)

    def can_append(self, seq_id: Hashable, num_tokens: int = 1, until: int | None = None) -> bool:
        return self.blocks_to_append(seq_id, num_tokens, until) <= self.num_free_blocks

    def append_slots(
        self, seq_id: Hashable, token_ids: Sequence[int], until: int | None = None
    ) -> list[tuple[int, int]]:
        """Reserve slots for `token_ids` after the sequence's current tokens (whose KV must be computed).

        `until`: the end of the positions this step computes; windowed groups cover only those (a prompt's next
        chunk, with `token_ids` empty). Returns the (src, dst) block copies the cache must perform first
        (copy-on-write of a shared partially filled last block).
        """
        seq = self.seqs[seq_id]
        if seq.on_cpu:
            raise InvalidRequest(f"sequence {seq_id!r} is swapped out; swap it in before appending")
        if token_ids:  # the new tokens are the first queries: what they cannot see goes first
            self._drop_out_of_window(seq, len(seq.token_ids))
        need = self.blocks_to_append(seq_id, len(token_ids), until)
        if need > self.num_free_blocks:
            raise OutOfBlocks(
                f"sequence {seq_id!r} needs {need} more KV blocks but only {self.num_free_blocks} are free; "
                f"preempt a sequence or raise the KV memory budget"
            )
        n, end = len(seq.token_ids), len(seq.token_ids) + len(token_ids)
        copies: list[tuple[int, int]] = []
        for manager, table in self._by_group(seq):
            copies += manager.append(table, n, end, until)
        seq.token_ids.extend(token_ids)
        return copies

    def _by_group(self, seq: SequenceBlocks) -> zip:
        """(group manager, table) pairs of `seq`."""
        return zip(self.group_managers, seq.block_tables, strict=True)

    def _drop_out_of_window(self, seq: SequenceBlocks, first_query: int) -> None:
        for group, (manager, table) in enumerate(self._by_group(seq)):
            seq.num_dropped[group] = manager.drop_out_of_window(table, seq.num_dropped[group], first_query)

    def commit(self, seq_id: Hashable, num_computed_tokens: int) -> None:
        """The first `num_computed_tokens` tokens' KV is computed: publish their full blocks so later prompts
        can hit them, then drop what windowed groups can no longer see."""
        seq = self.seqs[seq_id]
        if seq.on_cpu:
            return
        computed = min(num_computed_tokens, len(seq.token_ids))
        if self.enable_prefix_caching:
            first = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            stop = computed // self.block_size
            entries = list(self.pool.block_hashes(seq.token_ids, seq.extra_keys, first, stop, parent))
            for manager, table in self._by_group(seq):
                manager.publish(table, first, entries)
            seq.block_hashes += [key for _, _, key in entries]
        self._drop_out_of_window(seq, computed)

    # ------------------------------------------------------------ sharing/free
    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """`child_id` shares every block of `parent_id` (refcounts, no copy)."""
        if child_id in self.seqs:
            raise InvalidRequest(f"sequence {child_id!r} already exists; free it before forking into it")
        parent = self.seqs[parent_id]
        if parent.on_cpu:
            raise InvalidRequest(f"sequence {parent_id!r} is swapped out; swap it in before forking")
        for table in parent.block_tables:
            for block_id in held_blocks(table, on_cpu=False):
                self.pool.acquire(self.pool.blocks[block_id])
        self.seqs[child_id] = SequenceBlocks(
            block_tables=[list(table) for table in parent.block_tables],
            token_ids=list(parent.token_ids),
            extra_keys=parent.extra_keys,
            block_hashes=list(parent.block_hashes),
            num_dropped=list(parent.num_dropped),
        )

    def free(self, seq_id: Hashable) -> None:
        """Release every block of `seq_id`. Cached blocks stay reusable until evicted."""
        seq = self.seqs.pop(seq_id)
        for table in seq.block_tables:
            if seq.on_cpu:
                for cpu_block in held_blocks(table, on_cpu=True):
                    self.swap.release(cpu_block)
            else:
                self.pool.release_tail_first(table)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens of `seq_id` (speculative rollback, HF crop)."""
        seq = self.seqs[seq_id]
        if not 0 <= num_tokens <= len(seq.token_ids):
            raise InvalidRequest(f"cannot truncate {len(seq.token_ids)} tokens to {num_tokens}")
        for group in range(self.num_groups):
            if self.window_start(group, num_tokens) < seq.num_dropped[group]:
                raise InvalidRequest(
                    f"cannot roll {seq_id!r} back to {num_tokens} tokens: its sliding-window layers already freed "
                    f"the blocks a query there would read; roll back by fewer tokens"
                )
        keep = self.pool.blocks_needed(num_tokens)
        for table in seq.block_tables:
            self.pool.release_tail_first(table[keep:])
            del table[keep:]
        del seq.token_ids[num_tokens:]
        del seq.block_hashes[num_tokens // self.block_size :]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks stay allocated to their sequences)."""
        self.pool.reset_prefix_cache()
        for seq in self.seqs.values():
            seq.block_hashes.clear()

    # -------------------------------------------------------------------- swap
    def _distinct_blocks(self, seq_ids: Sequence[Hashable]) -> list[int]:
        return distinct_blocks((table, self.seqs[s].on_cpu) for s in seq_ids for table in self.seqs[s].block_tables)

    def can_swap_out(self, seq_ids: Sequence[Hashable]) -> bool:
        return len(self._distinct_blocks(seq_ids)) <= self.swap.num_free

    def swap_out(self, seq_ids: Sequence[Hashable]) -> list[tuple[int, int]]:
        """Move `seq_ids` (e.g. one request's forks, swapped together) to CPU blocks.

        Returns the (gpu_block, cpu_block) copies to perform before the GPU blocks are reused.
        """
        if any(self.seqs[s].on_cpu for s in seq_ids):
            raise InvalidRequest("a sequence in the group is already swapped out")
        copies = self.swap.swap_out(self.pool, [table for s in seq_ids for table in self.seqs[s].block_tables])
        for seq_id in seq_ids:
            self.seqs[seq_id].on_cpu = True
        return copies

    def can_swap_in(self, seq_ids: Sequence[Hashable]) -> bool:
        return len(self._distinct_blocks(seq_ids)) <= self.num_free_blocks

    def swap_in(self, seq_ids: Sequence[Hashable]) -> list[tuple[int, int]]:
        """Bring swapped-out `seq_ids` back. Returns the (cpu_block, gpu_block) copies to perform."""
        if not all(self.seqs[s].on_cpu for s in seq_ids):
            raise InvalidRequest("a sequence in the group is not swapped out")
        tables = [(group, table) for s in seq_ids for group, table in enumerate(self.seqs[s].block_tables)]
        copies = self.swap.swap_in(self.pool, tables)
        for seq_id in seq_ids:
            self.seqs[seq_id].block_hashes.clear()  # the new blocks are not published; recommit if wanted
            self.seqs[seq_id].on_cpu = False
        return copies

    # ------------------------------------------------------------------- stats
    def stats(self) -> BlockStats:
        resident = [(seq.block_tables, len(seq.token_ids)) for seq in self.seqs.values() if not seq.on_cpu]
        return collect_block_stats(self.pool, self.sliding_windows, resident, self.swap.num_used)
