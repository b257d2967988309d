"""BlockManager: pure-Python bookkeeping of the paged KV pool (no tensors).

Every physical block exists from start-up. Free blocks sit in an intrusive doubly-linked queue, so a
prefix-cache hit can take a block out of the middle in O(1). A freed block keeps its prefix hash
(lazy eviction): it is reused by a later hit, or evicted when it reaches the front of the queue (LRU).
Block 0 is the null/padding block and is never handed out.

Layer groups (see `kv_groups`): every sequence has one block table per group, all drawn from the one pool.
A windowed group replaces blocks that fall wholly out of its window with the null block and frees them, so
its share of a sequence stays bounded; its prefix-cache hits only need the blocks inside the window. A
windowed group also takes a long prompt's blocks chunk by chunk (`chunk=` / `until=`), never the whole prompt
at once, so with every layer windowed a sequence can grow past the pool's size.

The cache (`PagedKVCache`) does what this class decides: copy-on-write pairs and swap maps come back
from the calls that need them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from paged_backend.errors import InvalidRequest, OutOfBlocks

NULL_BLOCK = 0
CPU_NULL_BLOCK = -1  # a dropped (out-of-window) table entry while the sequence is swapped out


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    group: int = 0  # the layer group whose K/V it holds while taken
    # Prefix-cache identity, set once the block is full and its KV computed.
    hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly-linked queue of free blocks: front = evicted first. O(1) push, pop and remove."""

    def __init__(self) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def _link_after(self, anchor: Block, block: Block) -> None:
        block.prev, block.next = anchor, anchor.next
        anchor.next.prev = block
        anchor.next = block
        self.size += 1

    def append(self, block: Block) -> None:
        self._link_after(self._tail.prev, block)

    def appendleft(self, block: Block) -> None:
        self._link_after(self._head, block)

    def remove(self, block: Block) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.size -= 1

    def popleft(self) -> Block:
        if self.size == 0:
            raise IndexError("no free block")
        block = self._head.next
        self.remove(block)
        return block

    def __contains__(self, block: Block) -> bool:
        return block.prev is not None


@dataclass
class SequenceBlocks:
    """Per-sequence state: one block table per group, the token ids it stored, its committed block hashes."""

    block_tables: list[list[int]]
    token_ids: list[int]
    extra_keys: Hashable = None
    block_hashes: list[int] = field(default_factory=list)
    on_cpu: bool = False
    num_dropped: list[int] = field(default_factory=list)  # per group: leading entries already out of window

    @property
    def block_table(self) -> list[int]:
        return self.block_tables[0]


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


def default_block_hash(parent_hash: int | None, token_ids: tuple[int, ...], extra_keys: Hashable) -> int:
    return hash((parent_hash, token_ids, extra_keys))


def _held(table: list[int], on_cpu: bool) -> list[int]:
    """The table's real entries: dropped out-of-window entries are the null block (CPU_NULL_BLOCK on CPU)."""
    null = CPU_NULL_BLOCK if on_cpu else NULL_BLOCK
    return [block_id for block_id in table if block_id != null]


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
        self.sliding_windows = tuple(sliding_windows)
        self.num_groups = len(self.sliding_windows)
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * (num_blocks - 1))
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue()
        for block in self.blocks[1:]:
            self.free_queue.append(block)
        # Per group: prefix hash -> the block holding that prefix's K/V for this group's layers.
        self.cached_by_group: list[dict[int, Block]] = [{} for _ in self.sliding_windows]
        self.seqs: dict[Hashable, SequenceBlocks] = {}
        self.cpu_free = list(range(num_cpu_blocks - 1, -1, -1))
        self.cpu_ref_counts = [0] * num_cpu_blocks
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found cached

    # ----------------------------------------------------------------- queries
    @property
    def cached(self) -> dict[int, Block]:
        """The first group's prefix index (the only one without layer groups)."""
        return self.cached_by_group[0]

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty or evictable cached)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence (O(1): everything not in the free queue)."""
        return self.num_blocks - 1 - len(self.free_queue)

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
        return [len(_held(table, seq.on_cpu)) for table in seq.block_tables]

    def num_tokens(self, seq_id: Hashable) -> int:
        return len(self.seqs[seq_id].token_ids)

    def slot(self, seq_id: Hashable, position: int, group: int = 0) -> int:
        table = self.seqs[seq_id].block_tables[group]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def slot_mapping(self, seq_id: Hashable, start: int, end: int, group: int = 0) -> list[int]:
        """Physical slots of positions [start, end) of `seq_id` in `group`'s blocks."""
        table, bs = self.seqs[seq_id].block_tables[group], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def window_start(self, group: int, first_query: int) -> int:
        """First block index of `group` a query at `first_query` (or later) can still see."""
        window = self.sliding_windows[group]
        return 0 if window is None else max(0, first_query - window + 1) // self.block_size

    def peak_blocks_per_sequence(self, num_tokens: int, chunk: int) -> int:
        """Most blocks a sequence of `num_tokens` holds at once (every group) when it computes at most `chunk`
        tokens per step: full groups hold every block; a windowed group its window plus one step's chunk."""
        peak = 0
        for window in self.sliding_windows:
            held = self.blocks_needed(num_tokens)
            if window is not None:  # the chunk's queries see back window - 1 tokens; +1 for an unaligned start
                held = min(held, self.blocks_needed(window - 1 + min(chunk, num_tokens)) + 1)
            peak += held
        return peak

    @property
    def usable_blocks(self) -> int:
        """Blocks one sequence may hold on its own: all but the null block and the admission watermark."""
        return self.num_blocks - 1 - self.watermark_blocks

    def fits_alone(self, num_tokens: int, chunk: int) -> bool:
        """Whether a sequence of `num_tokens`, computed `chunk` tokens a step, fits the pool with nothing else."""
        return self.peak_blocks_per_sequence(num_tokens, chunk) <= self.usable_blocks

    def _cover(self, group: int, num_tokens: int, until: int | None) -> int:
        """Leading tokens whose slots `group` holds: all of them in a full group, only those before `until` (the
        end of the step's chunk) in a windowed group."""
        if until is None or self.sliding_windows[group] is None:
            return num_tokens
        return min(until, num_tokens)

    # -------------------------------------------------------------- allocation
    def _prefix_hashes(self, token_ids: Sequence[int], extra_keys: Hashable, stop: int) -> list[int]:
        hashes: list[int] = []
        bs, parent = self.block_size, None
        for i in range(stop):
            parent = self.hash_fn(parent, tuple(token_ids[i * bs : (i + 1) * bs]), extra_keys)
            hashes.append(parent)
        return hashes

    def _lookup(self, group: int, index: int, key: int, token_ids: Sequence[int], parent: int | None) -> Block | None:
        block = self.cached_by_group[group].get(key)
        tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
        # Compare contents: a colliding hash must never serve another prefix's KV.
        if block is None or block.token_ids != tokens or block.parent_hash != parent:
            return None
        return block

    def _find_cached_prefix(
        self, token_ids: Sequence[int], extra_keys: Hashable, lookup: bool = True
    ) -> tuple[list[list[Block | None]], list[int]]:
        """Per group, the cached blocks of the longest prefix every group can serve (None where a windowed group
        needs nothing), and that prefix's hashes. The last token is always left to recompute."""
        if not self.enable_prefix_caching or not lookup:
            return [[] for _ in self.sliding_windows], []
        limit = (len(token_ids) - 1) // self.block_size
        full = [g for g, w in enumerate(self.sliding_windows) if w is None]
        hashes: list[int] = []
        found: list[list[Block | None]] = [[] for _ in self.sliding_windows]
        parent = None
        for i in range(limit):
            key = self.hash_fn(parent, tuple(token_ids[i * self.block_size : (i + 1) * self.block_size]), extra_keys)
            row = [self._lookup(g, i, key, token_ids, parent) for g in range(self.num_groups)]
            if any(row[g] is None for g in full):
                break  # full-attention groups need every leading block
            hashes.append(key)
            for g, block in enumerate(row):
                found[g].append(block)
            parent = key
        # Windowed groups only need the blocks a query right after the hit can see.
        hit = len(hashes)
        while hit and not all(
            all(found[g][i] is not None for i in range(self.window_start(g, hit * self.block_size), hit))
            for g, w in enumerate(self.sliding_windows)
            if w is not None
        ):
            hit -= 1
        hits = []
        for g in range(self.num_groups):
            start = self.window_start(g, hit * self.block_size)
            hits.append([None] * start + found[g][start:hit])
        return hits, hashes[:hit]

    def _fresh_blocks(self, group: int, num_tokens: int, hits: list[Block | None], chunk: int | None) -> int:
        """Blocks `group` takes from the pool for a new sequence: past its hits, up to what it covers."""
        until = None if chunk is None else len(hits) * self.block_size + chunk
        return self.blocks_needed(self._cover(group, num_tokens, until)) - len(hits)

    def _blocks_to_take(self, token_ids: Sequence[int], hits: list[list[Block | None]], chunk: int | None) -> int:
        need = 0
        for group, group_hits in enumerate(hits):
            need += self._fresh_blocks(group, len(token_ids), group_hits, chunk)
            need += sum(1 for b in group_hits if b is not None and b.ref_count == 0)  # cached-free hits leave the queue
        return need

    def can_allocate(
        self, token_ids: Sequence[int], extra_keys: Hashable = None, *, lookup: bool = True, chunk: int | None = None
    ) -> bool:
        """Whether `allocate` would succeed now while keeping the watermark free."""
        hits, _ = self._find_cached_prefix(token_ids, extra_keys, lookup)
        return self._blocks_to_take(token_ids, hits, chunk) <= self.num_free_blocks - self.watermark_blocks

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
        need = self._blocks_to_take(token_ids, hits, chunk)
        if need > self.num_free_blocks:
            raise OutOfBlocks(
                f"{need} KV blocks needed for a {len(token_ids)}-token sequence but only "
                f"{self.num_free_blocks} are free; raise num_blocks / the KV memory budget or shorten the prompt"
            )
        tables = []
        for group, group_hits in enumerate(hits):
            for block in group_hits:
                if block is not None:
                    if block.ref_count == 0:
                        self.free_queue.remove(block)
                    block.ref_count += 1
            fresh = self._fresh_blocks(group, len(token_ids), group_hits, chunk)
            table = [NULL_BLOCK if b is None else b.block_id for b in group_hits]
            tables.append(table + [self._take_free_block(group).block_id for _ in range(fresh)])
        self.seqs[seq_id] = SequenceBlocks(
            block_tables=tables,
            token_ids=list(token_ids),
            extra_keys=extra_keys,
            block_hashes=hashes,
            num_dropped=[self.window_start(g, len(hashes) * self.block_size) for g in range(self.num_groups)],
        )
        if self.enable_prefix_caching:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += len(hashes) * self.block_size
        return len(hashes) * self.block_size

    def _take_free_block(self, group: int) -> Block:
        block = self.free_queue.popleft()
        if block.hash is not None:  # evict its cached prefix
            self._unhash(block)
        block.ref_count = 1
        block.group = group
        return block

    def _cow_needed(self, seq: SequenceBlocks, group: int) -> bool:
        """Writing the next token would land in a partially filled block others can see."""
        n, table = len(seq.token_ids), seq.block_tables[group]
        if n % self.block_size == 0 or n // self.block_size >= len(table) or seq.on_cpu:
            return False
        return self.blocks[table[n // self.block_size]].ref_count > 1

    def blocks_to_append(self, seq_id: Hashable, num_tokens: int = 1, until: int | None = None) -> int:
        """Free blocks `append_slots(seq_id, num_tokens tokens, until)` takes."""
        seq = self.seqs[seq_id]
        n = len(seq.token_ids)
        need = 0
        for group, table in enumerate(seq.block_tables):
            need += max(0, self.blocks_needed(self._cover(group, n + num_tokens, until)) - len(table))
            need += num_tokens > 0 and self._cow_needed(seq, group)
        return need

    def can_append(self, seq_id: Hashable, num_tokens: int = 1, until: int | None = None) -> bool:
        return self.blocks_to_append(seq_id, num_tokens, until) <= self.num_free_blocks

    def append_slots(self, seq_id: Hashable, token_ids: Sequence[int], until: int | None = None) -> list[tuple[int, int]]:
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
        copies: list[tuple[int, int]] = []
        n, end = len(seq.token_ids), len(seq.token_ids) + len(token_ids)
        for group, table in enumerate(seq.block_tables):
            if token_ids and n % self.block_size and n // self.block_size < len(table):
                index = n // self.block_size
                last = self.blocks[table[index]]
                if last.ref_count > 1:
                    fresh = self._take_free_block(group)
                    last.ref_count -= 1
                    table[index] = fresh.block_id
                    copies.append((last.block_id, fresh.block_id))
                elif last.hash is not None:
                    self._unhash(last)  # about to be overwritten past its cached contents
            grow = self.blocks_needed(self._cover(group, end, until)) - len(table)
            table.extend(self._take_free_block(group).block_id for _ in range(grow))
        seq.token_ids.extend(token_ids)
        return copies

    def _unhash(self, block: Block) -> None:
        cached = self.cached_by_group[block.group]
        if cached.get(block.hash) is block:
            del cached[block.hash]
        block.hash, block.parent_hash, block.token_ids = None, None, ()

    def _drop_out_of_window(self, seq: SequenceBlocks, first_query: int) -> None:
        """Free windowed groups' blocks that no query at `first_query` or later can see (tail-first, like free)."""
        for group, table in enumerate(seq.block_tables):
            stop = self.window_start(group, first_query)
            if stop <= seq.num_dropped[group]:
                continue
            for i in range(stop - 1, seq.num_dropped[group] - 1, -1):
                if table[i] != NULL_BLOCK:
                    self._release(self.blocks[table[i]])
                    table[i] = NULL_BLOCK
            seq.num_dropped[group] = stop

    def commit(self, seq_id: Hashable, num_computed_tokens: int) -> None:
        """The first `num_computed_tokens` tokens' KV is computed: publish their full blocks so later prompts
        can hit them, then drop what windowed groups can no longer see."""
        seq = self.seqs[seq_id]
        if self.enable_prefix_caching and not seq.on_cpu:
            self._publish(seq, num_computed_tokens)
        if not seq.on_cpu:
            self._drop_out_of_window(seq, min(num_computed_tokens, len(seq.token_ids)))

    def _publish(self, seq: SequenceBlocks, num_computed_tokens: int) -> None:
        bs = self.block_size
        full = min(num_computed_tokens, len(seq.token_ids)) // bs
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            key = self.hash_fn(parent, tokens, seq.extra_keys)
            for group, table in enumerate(seq.block_tables):
                if i >= len(table) or table[i] == NULL_BLOCK:
                    continue
                block, cached = self.blocks[table[i]], self.cached_by_group[group]
                if key not in cached and block.hash is None:
                    block.hash, block.parent_hash, block.token_ids = key, parent, tokens
                    cached[key] = block
            seq.block_hashes.append(key)
            parent = key

    # ------------------------------------------------------------ sharing/free
    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """`child_id` shares every block of `parent_id` (refcounts, no copy)."""
        if child_id in self.seqs:
            raise InvalidRequest(f"sequence {child_id!r} already exists; free it before forking into it")
        parent = self.seqs[parent_id]
        if parent.on_cpu:
            raise InvalidRequest(f"sequence {parent_id!r} is swapped out; swap it in before forking")
        for table in parent.block_tables:
            for block_id in table:
                self.blocks[block_id].ref_count += block_id != NULL_BLOCK
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
                for cpu_block in _held(table, on_cpu=True):
                    self._release_cpu(cpu_block)
            else:  # tail blocks first: their prefixes are the least likely to be hit again, so evict them first
                for block_id in reversed(_held(table, on_cpu=False)):
                    self._release(self.blocks[block_id])

    def _release(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count < 0:
            raise AssertionError(f"block {block.block_id} freed twice")
        if block.ref_count == 0:
            if block.hash is None:
                self.free_queue.appendleft(block)  # nothing to keep: reuse before cached ones
            else:
                self.free_queue.append(block)

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
        keep = self.blocks_needed(num_tokens)
        for table in seq.block_tables:
            for block_id in reversed(table[keep:]):
                self._release(self.blocks[block_id])
            del table[keep:]
        del seq.token_ids[num_tokens:]
        del seq.block_hashes[num_tokens // self.block_size :]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks stay allocated to their sequences)."""
        for cached in self.cached_by_group:
            for block in list(cached.values()):
                self._unhash(block)
        for seq in self.seqs.values():
            seq.block_hashes.clear()

    # -------------------------------------------------------------------- swap
    def _distinct_blocks(self, seq_ids: Sequence[Hashable]) -> list[int]:
        seen: dict[int, None] = {}
        for seq_id in seq_ids:
            for table in self.seqs[seq_id].block_tables:
                seen.update(dict.fromkeys(_held(table, self.seqs[seq_id].on_cpu)))
        return list(seen)

    def can_swap_out(self, seq_ids: Sequence[Hashable]) -> bool:
        return len(self._distinct_blocks(seq_ids)) <= len(self.cpu_free)

    def swap_out(self, seq_ids: Sequence[Hashable]) -> list[tuple[int, int]]:
        """Move `seq_ids` (e.g. one request's forks, swapped together) to CPU blocks.

        Returns the (gpu_block, cpu_block) copies to perform before the GPU blocks are reused.
        """
        if any(self.seqs[s].on_cpu for s in seq_ids):
            raise InvalidRequest("a sequence in the group is already swapped out")
        gpu_blocks = self._distinct_blocks(seq_ids)
        if len(gpu_blocks) > len(self.cpu_free):
            raise OutOfBlocks(
                f"swapping out needs {len(gpu_blocks)} CPU blocks but {len(self.cpu_free)} are free; raise --swap-space"
            )
        mapping = {gpu: self.cpu_free.pop() for gpu in gpu_blocks}
        copies = list(mapping.items())
        mapping[NULL_BLOCK] = CPU_NULL_BLOCK
        for seq_id in seq_ids:
            seq = self.seqs[seq_id]
            for g, table in enumerate(seq.block_tables):
                for gpu in reversed(table):
                    if gpu != NULL_BLOCK:
                        self._release(self.blocks[gpu])
                seq.block_tables[g] = [mapping[gpu] for gpu in table]
                for cpu in seq.block_tables[g]:
                    if cpu != CPU_NULL_BLOCK:
                        self.cpu_ref_counts[cpu] += 1
            seq.on_cpu = True
        return copies

    def can_swap_in(self, seq_ids: Sequence[Hashable]) -> bool:
        return len(self._distinct_blocks(seq_ids)) <= self.num_free_blocks

    def swap_in(self, seq_ids: Sequence[Hashable]) -> list[tuple[int, int]]:
        """Bring swapped-out `seq_ids` back. Returns the (cpu_block, gpu_block) copies to perform."""
        if not all(self.seqs[s].on_cpu for s in seq_ids):
            raise InvalidRequest("a sequence in the group is not swapped out")
        cpu_blocks = self._distinct_blocks(seq_ids)
        if len(cpu_blocks) > self.num_free_blocks:
            raise OutOfBlocks(f"swapping in needs {len(cpu_blocks)} free KV blocks, {self.num_free_blocks} free")
        group_of = {cpu: g for s in seq_ids for g, table in enumerate(self.seqs[s].block_tables) for cpu in table}
        mapping = {cpu: self._take_free_block(group_of[cpu]) for cpu in cpu_blocks}
        for block in mapping.values():
            block.ref_count = 0
        for seq_id in seq_ids:
            seq = self.seqs[seq_id]
            for g, table in enumerate(seq.block_tables):
                for cpu in table:
                    if cpu != CPU_NULL_BLOCK:
                        mapping[cpu].ref_count += 1
                        self._release_cpu(cpu)
                seq.block_tables[g] = [NULL_BLOCK if cpu == CPU_NULL_BLOCK else mapping[cpu].block_id for cpu in table]
            seq.block_hashes.clear()  # the new blocks are not published; recommit if wanted
            seq.on_cpu = False
        return [(cpu, block.block_id) for cpu, block in mapping.items()]

    def _release_cpu(self, cpu_block: int) -> None:
        self.cpu_ref_counts[cpu_block] -= 1
        if self.cpu_ref_counts[cpu_block] == 0:
            self.cpu_free.append(cpu_block)

    # ------------------------------------------------------------------- stats
    def stats(self) -> BlockStats:
        bs = self.block_size
        fill: dict[int, int] = {}
        entries = [0] * self.num_groups
        logical = 0
        for seq in self.seqs.values():
            if seq.on_cpu:
                continue
            n = len(seq.token_ids)
            logical += n
            for group, table in enumerate(seq.block_tables):
                for i, block_id in enumerate(table):
                    if block_id != NULL_BLOCK:
                        entries[group] += 1
                        fill[block_id] = max(fill.get(block_id, 0), min(bs, n - i * bs))
        used, shared, cached_free, tokens = ([0] * self.num_groups for _ in range(4))
        for block in self.blocks[1:]:  # one pass: stats() also feeds the KV map's per-step history
            if block.ref_count:
                used[block.group] += 1
                shared[block.group] += block.ref_count > 1
            elif block.hash is not None:
                cached_free[block.group] += 1
        for block_id, count in fill.items():
            tokens[self.blocks[block_id].group] += count
        groups = [
            GroupStats(window, used[g], shared[g], cached_free[g], tokens[g], entries[g] - used[g])
            for g, window in enumerate(self.sliding_windows)
        ]
        cached = sum(g.cached_blocks for g in groups)
        return BlockStats(
            total_blocks=self.num_blocks - 1,
            used_blocks=self.num_used_blocks,
            shared_blocks=sum(g.shared_blocks for g in groups),
            cached_blocks=cached,
            free_blocks=self.num_free_blocks - cached,
            block_size=bs,
            tokens_stored=sum(fill.values()),
            logical_tokens=logical,
            blocks_saved_by_sharing=sum(entries) - len(fill),
            cpu_blocks_used=len(self.cpu_ref_counts) - len(self.cpu_free),
            groups=tuple(groups),
        )
