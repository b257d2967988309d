"""Random allocate / append / fork / truncate / swap / free sequences against the BlockManager.

A shadow memory (slot -> token id) plays the KV pool: writes go where the manager says, copy-on-write and
swap maps are applied to it, and after every step each live sequence must read back exactly its own
tokens. That checks prefix-cache hits, CoW and swaps by content, not just by counts.
"""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_backend import BlockManager, OutOfBlocks

BLOCK_SIZE = 4
NUM_BLOCKS = 24
NUM_CPU_BLOCKS = 16
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # tiny vocab: prefix hits are frequent


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, num_cpu_blocks=NUM_CPU_BLOCKS)
        self.gpu_mem: dict[int, int] = {}
        self.cpu_mem: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    # ------------------------------------------------------------- helpers
    def _live(self, on_cpu=False):
        return [s for s in self.tokens if self.bm.seqs[s].on_cpu == on_cpu]

    def _write(self, seq_id, start):
        for pos in range(start, len(self.tokens[seq_id])):
            self.gpu_mem[self.bm.slot(seq_id, pos)] = self.tokens[seq_id][pos]

    def _copy_blocks(self, pairs, src_mem, dst_mem):
        for src, dst in pairs:
            for offset in range(BLOCK_SIZE):
                if src * BLOCK_SIZE + offset in src_mem:
                    dst_mem[dst * BLOCK_SIZE + offset] = src_mem[src * BLOCK_SIZE + offset]
                else:
                    dst_mem.pop(dst * BLOCK_SIZE + offset, None)

    # --------------------------------------------------------------- rules
    @rule(prompt=tokens)
    def allocate(self, prompt):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        free_before = self.bm.num_free_blocks
        try:
            cached = self.bm.allocate(seq_id, prompt)
        except OutOfBlocks:
            assert self.bm.num_free_blocks == free_before  # a failed allocation changes nothing
            return
        assert cached < len(prompt) and cached % BLOCK_SIZE == 0  # last token always recomputed
        for pos in range(cached):  # a hit must hold exactly this prompt's tokens
            assert self.gpu_mem[self.bm.slot(seq_id, pos)] == prompt[pos]
        self.tokens[seq_id] = list(prompt)
        self._write(seq_id, cached)
        self.bm.commit(seq_id, len(prompt))

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
        for pos in range(start, start + len(new)):
            block = self.bm.blocks[self.bm.block_table(seq_id)[pos // BLOCK_SIZE]]
            assert block.ref_count == 1 and block.hash is None
        self.tokens[seq_id] += new
        self._write(seq_id, start)
        self.bm.commit(seq_id, len(self.tokens[seq_id]))

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
        holders = Counter(b for s in self._live() for b in self.bm.block_table(s))
        for block in self.bm.blocks[1:]:
            assert block.ref_count == holders.get(block.block_id, 0)
            assert (block.ref_count == 0) == (block in self.bm.free_queue)  # never free and held
        assert self.bm.blocks[0].ref_count == 0 and self.bm.blocks[0] not in self.bm.free_queue
        assert self.bm.num_used_blocks == sum(1 for b in self.bm.blocks[1:] if b.ref_count > 0)
        cpu_holders = Counter(b for s in self._live(on_cpu=True) for b in self.bm.block_table(s))
        for cpu_block, count in enumerate(self.bm.cpu_ref_counts):
            assert count == cpu_holders.get(cpu_block, 0)

    @invariant()
    def cache_index_is_consistent(self):
        for key, block in self.bm.cached.items():
            assert block.hash == key and len(block.token_ids) == BLOCK_SIZE

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq_id in self._live():
            got = [self.gpu_mem.get(self.bm.slot(seq_id, p)) for p in range(len(self.tokens[seq_id]))]
            assert got == self.tokens[seq_id]

    def teardown(self):
        for seq_id in list(self.tokens):
            self.bm.free(seq_id)
        stats = self.bm.stats()
        assert self.bm.num_free_blocks == NUM_BLOCKS - 1
        assert stats.free_blocks + stats.cached_blocks == stats.total_blocks
        assert stats.cpu_blocks_used == 0


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase
