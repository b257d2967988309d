"""BlockPool: every physical KV block, its refcount, the free queue and the prefix cache (no tensors).

Every block exists from start-up. Free blocks sit in an intrusive doubly-linked queue, so a prefix-cache hit
can take a block out of the middle in O(1). A freed block keeps its prefix hash (lazy eviction): a later hit
revives it, or it is evicted when it reaches the front of the queue (LRU). Block 0 is the null/padding block
and is never handed out. A block holds one layer group's K/V at a time (`Block.group`), and each group has
its own prefix index, since the same prefix hash names different K/V in different groups.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

NULL_BLOCK = 0


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


def default_block_hash(parent_hash: int | None, token_ids: tuple[int, ...], extra_keys: Hashable) -> int:
    return hash((parent_hash, token_ids, extra_keys))


class BlockPool:
    """The blocks of one pool of `num_blocks` (block 0 included), shared by `num_groups` layer groups."""

    def __init__(self, num_blocks: int, block_size: int, num_groups: int, hash_fn=default_block_hash) -> None:
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue()
        for block in self.blocks[1:]:
            self.free_queue.append(block)
        # Per group: prefix hash -> the block holding that prefix's K/V for this group's layers.
        self.cached_by_group: list[dict[int, Block]] = [{} for _ in range(num_groups)]

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (empty or evictable cached)."""
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence (O(1): everything not in the free queue)."""
        return len(self.blocks) - 1 - len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----------------------------------------------------------- refcounts
    def take(self, group: int) -> Block:
        """A free block for `group`, held once; the least recently freed cached prefix is evicted for it."""
        block = self.free_queue.popleft()
        if block.hash is not None:
            self.unhash(block)
        block.ref_count = 1
        block.group = group
        return block

    def take_ids(self, group: int, count: int) -> list[int]:
        """`count` blocks for `group`, their ids ascending: a table's run of fresh blocks then lies in address order
        (freed tables come back tail first, so the queue holds their blocks in descending runs), which the attention
        kernels stream faster than blocks read back to front."""
        return sorted(self.take(group).block_id for _ in range(count))

    def acquire(self, block: Block) -> None:
        """One more holder (a prefix hit or a fork); an idle cached block leaves the free queue."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
        block.ref_count += 1

    def release(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count < 0:
            raise AssertionError(f"block {block.block_id} freed twice")
        if block.ref_count == 0:
            if block.hash is None:
                self.free_queue.appendleft(block)  # nothing to keep: reuse before cached ones
            else:
                self.free_queue.append(block)

    def release_tail_first(self, block_ids: Sequence[int]) -> None:
        """Release a table's entries (null entries skipped) from the last one: a sequence's tail prefixes are
        the least likely to be hit again, so they reach the front of the eviction queue first."""
        for block_id in reversed(block_ids):
            if block_id != NULL_BLOCK:
                self.release(self.blocks[block_id])

    # -------------------------------------------------------- prefix cache
    def block_hashes(
        self, token_ids: Sequence[int], extra_keys: Hashable, start: int, stop: int, parent: int | None
    ) -> Iterator[tuple[int | None, tuple[int, ...], int]]:
        """(parent hash, tokens, hash) of the full blocks `start`..`stop`-1, each hash chained on the one before."""
        bs = self.block_size
        for i in range(start, stop):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = self.hash_fn(parent, tokens, extra_keys)
            yield parent, tokens, key
            parent = key

    def lookup(self, group: int, key: int, parent: int | None, tokens: tuple[int, ...]) -> Block | None:
        block = self.cached_by_group[group].get(key)
        # Compare contents: a colliding hash must never serve another prefix's KV.
        if block is None or block.token_ids != tokens or block.parent_hash != parent:
            return None
        return block

    def publish(self, block: Block, key: int, parent: int | None, tokens: tuple[int, ...]) -> None:
        """Make `block`'s computed K/V findable under `key` (the first block published for a key wins)."""
        cached = self.cached_by_group[block.group]
        if key not in cached and block.hash is None:
            block.hash, block.parent_hash, block.token_ids = key, parent, tokens
            cached[key] = block

    def unhash(self, block: Block) -> None:
        cached = self.cached_by_group[block.group]
        if cached.get(block.hash) is block:
            del cached[block.hash]
        block.hash, block.parent_hash, block.token_ids = None, None, ()

    def reset_prefix_cache(self) -> None:
        for cached in self.cached_by_group:
            for block in list(cached.values()):
                self.unhash(block)
