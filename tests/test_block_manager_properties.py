"""Random allocate / append / fork / truncate / swap / free sequences against the BlockManager.

A shadow memory (slot -> token id) plays the KV pool: writes go where the manager says, copy-on-write and
swap maps are applied to it, and after every step each live sequence must read back exactly its own
tokens. That checks prefix-cache hits, CoW and swaps by content, not just by counts.

The grouped machine runs the same rules with three layer groups (full attention, windows of 6 and 9 tokens):
every group's table is written and read back, and windowed groups must hold only blocks a later query can see.
Prompts are also prefilled in chunks, as the engine's scheduler does: windowed groups then take their blocks
chunk by chunk and never hold more than their window plus one chunk.
"""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_backend import BlockManager, InvalidRequest, OutOfBlocks
from paged_backend.core.block_manager import CPU_NULL_BLOCK, NULL_BLOCK

BLOCK_SIZE = 4
NUM_BLOCKS = 24
NUM_CPU_BLOCKS = 16
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # tiny vocab: prefix hits are frequent


class BlockManagerMachine(RuleBasedStateMachine):
    WINDOWS: tuple[int | None, ...] = (None,)

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, num_cpu_blocks=NUM_CPU_BLOCKS, sliding_windows=self.WINDOWS)
        self.gpu_mem: dict[int, int] = {}
        self.cpu_mem: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    # ------------------------------------------------------------- helpers
    def _live(self, on_cpu=False):
        return [s for s in self.tokens if self.bm.seqs[s].on_cpu == on_cpu]

    def _groups(self):
        return range(len(self.WINDOWS))

    def _visible(self, seq_id, group):
        """Positions whose block `group` still holds (a windowed group dropped the ones before)."""
        return range(self.bm.seqs[seq_id].num_dropped[group] * BLOCK_SIZE, len(self.tokens[seq_id]))

    def _write(self, seq_id, start, end=None):
        for group in self._groups():
            for pos in range(start, len(self.tokens[seq_id]) if end is None else end):
                self.gpu_mem[self.bm.slot(seq_id, pos, group)] = self.tokens[seq_id][pos]

    def _check_window_bound(self, seq_id):
        for group, window in enumerate(self.WINDOWS):
            if window is not None:
                assert self.bm.num_blocks_held(seq_id)[group] <= -(-window // BLOCK_SIZE) + 1

    def _copy_blocks(self, pairs, src_mem, dst_mem):
        for src, dst in pairs:
            for offset in range(BLOCK_SIZE):
                if src * BLOCK_SIZE + offset in src_mem:
                    dst_mem[dst * BLOCK_SIZE + offset] = src_mem[src * BLOCK_SIZE + offset]
                else:
                    dst_mem.pop(dst * BLOCK_SIZE + offset, None)

    # --------------------------------------------------------------- rules
    @rule(prompt=tokens, chunk=st.none() | st.integers(1, 6))
    def allocate(self, prompt, chunk):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        free_before = self.bm.num_free_blocks
        try:
            cached = self.bm.allocate(seq_id, prompt, chunk=chunk)
        except OutOfBlocks:
            assert self.bm.num_free_blocks == free_before  # a failed allocation changes nothing
            return
        assert cached < len(prompt) and cached % BLOCK_SIZE == 0  # last token always recomputed
        self.tokens[seq_id] = list(prompt)
        for group in self._groups():  # a hit must hold exactly this prompt's tokens, in every group
            for pos in self._visible(seq_id, group):
                if pos < cached:
                    assert self.gpu_mem[self.bm.slot(seq_id, pos, group)] == prompt[pos]
        step = chunk or len(prompt)
        for start in range(cached, len(prompt), step):  # the scheduler's prefill chunks
            end = min(start + step, len(prompt))
            if start > cached:
                if not self.bm.can_append(seq_id, 0, until=end):
                    self.bm.free(seq_id)  # what a recompute preemption does
                    del self.tokens[seq_id]
                    return
                assert self.bm.append_slots(seq_id, [], until=end) == []
            self._write(seq_id, start, end)
            self.bm.commit(seq_id, end)
            for group, window in enumerate(self.WINDOWS):
                if window is not None:
                    assert self.bm.num_blocks_held(seq_id)[group] <= -(-(window - 1 + step) // BLOCK_SIZE) + 1
        self._check_window_bound(seq_id)

    @precondition(lambda self: self._live())
    @rule(data=st.data(), new=tokens)
    def append(self, data, new):
        seq_id = data.draw(st.sampled_from(self._live()))
        start = len(self.tokens[seq_id])
        if not self.bm.can_append(seq_id, len(new)):
            return
        copies = self.bm.append_slots(seq_id, new)
        self._copy_blocks(copies, self.gpu_mem, self.gpu_mem)
        # No two live sequences may write the same physical slot: written blocks are exclusive.
        for group in self._groups():
            for pos in range(start, start + len(new)):
                block = self.bm.blocks[self.bm.block_table(seq_id, group)[pos // BLOCK_SIZE]]
                assert block.ref_count == 1 and block.hash is None and block.group == group
        self.tokens[seq_id] += new
        self._write(seq_id, start)
        self.bm.commit(seq_id, len(self.tokens[seq_id]))
        self._check_window_bound(seq_id)

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._live()))
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def truncate(self, data):
        seq_id = data.draw(st.sampled_from(self._live()))
        keep = data.draw(st.integers(1, len(self.tokens[seq_id])))
        if any(self.bm.window_start(g, keep) < self.bm.seqs[seq_id].num_dropped[g] for g in self._groups()):
            with pytest.raises(InvalidRequest, match="sliding-window"):  # that KV is gone: refused, nothing changes
                self.bm.truncate(seq_id, keep)
            return
        self.bm.truncate(seq_id, keep)
        del self.tokens[seq_id][keep:]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq_id)
        del self.tokens[seq_id]

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def swap_out(self, data):
        seq_id = data.draw(st.sampled_from(self._live()))
        if self.bm.can_swap_out([seq_id]):
            self._copy_blocks(self.bm.swap_out([seq_id]), self.gpu_mem, self.cpu_mem)

    @precondition(lambda self: self._live(on_cpu=True))
    @rule(data=st.data())
    def swap_in(self, data):
        seq_id = data.draw(st.sampled_from(self._live(on_cpu=True)))
        if self.bm.can_swap_in([seq_id]):
            self._copy_blocks(self.bm.swap_in([seq_id]), self.cpu_mem, self.gpu_mem)

    # ---------------------------------------------------------- invariants
    @invariant()
    def refcounts_match_tables(self):
        tables = [(s, g, t) for s in self._live() for g, t in enumerate(self.bm.block_tables(s))]
        holders = Counter(b for _, _, t in tables for b in t if b != NULL_BLOCK)
        for seq_id, group, table in tables:  # dropped entries are exactly the leading ones, and null
            dropped = self.bm.seqs[seq_id].num_dropped[group]
            assert all(b == NULL_BLOCK for b in table[:dropped]) and NULL_BLOCK not in table[dropped:]
            assert all(self.bm.blocks[b].group == group for b in table[dropped:])
        for block in self.bm.blocks[1:]:
            assert block.ref_count == holders.get(block.block_id, 0)
            assert (block.ref_count == 0) == (block in self.bm.pool.free_queue)  # never free and held
        assert self.bm.blocks[0].ref_count == 0 and self.bm.blocks[0] not in self.bm.pool.free_queue
        assert self.bm.num_used_blocks == sum(1 for b in self.bm.blocks[1:] if b.ref_count > 0)
        cpu_holders = Counter(
            b for s in self._live(on_cpu=True) for t in self.bm.block_tables(s) for b in t if b != CPU_NULL_BLOCK
        )
        for cpu_block, count in enumerate(self.bm.swap.ref_counts):
            assert count == cpu_holders.get(cpu_block, 0)

    @invariant()
    def cache_index_is_consistent(self):
        for group, cached in enumerate(self.bm.pool.cached_by_group):
            for key, block in cached.items():
                assert block.hash == key and len(block.token_ids) == BLOCK_SIZE and block.group == group

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq_id in self._live():
            for group in self._groups():
                visible = self._visible(seq_id, group)
                got = [self.gpu_mem.get(self.bm.slot(seq_id, p, group)) for p in visible]
                assert got == self.tokens[seq_id][visible.start :]

    def teardown(self):
        for seq_id in list(self.tokens):
            self.bm.free(seq_id)
        stats = self.bm.stats()
        assert self.bm.num_free_blocks == NUM_BLOCKS - 1
        assert stats.free_blocks + stats.cached_blocks == stats.total_blocks
        assert stats.cpu_blocks_used == 0
        assert all(g.used_blocks == 0 for g in stats.groups) and len(stats.groups) == len(self.WINDOWS)


class GroupedBlockManagerMachine(BlockManagerMachine):
    WINDOWS = (None, 6, 9)


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
GroupedBlockManagerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase
test_grouped_block_manager_state_machine = GroupedBlockManagerMachine.TestCase
