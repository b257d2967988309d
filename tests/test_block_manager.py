"""BlockManager behaviour pinned by name: sharing, prefix caching, eviction, CoW, errors, stats."""

import pytest

from paged_backend import BlockManager, InvalidRequest, OutOfBlocks


def test_common_prefix_of_100_tokens_shares_its_six_full_blocks():
    bm = BlockManager(64, 16)
    prefix = list(range(1000, 1100))
    assert bm.allocate("a", prefix + [1, 2, 3]) == 0
    bm.commit("a", 103)
    assert bm.allocate("b", prefix + [7, 8]) == 96
    assert bm.block_table("a")[:6] == bm.block_table("b")[:6]
    assert bm.block_table("a")[6] != bm.block_table("b")[6]
    stats = bm.stats()
    assert stats.shared_blocks == 6 and stats.blocks_saved_by_sharing == 6
    assert bm.prefix_hits == 96


def test_colliding_hash_with_different_tokens_is_not_reused():
    bm = BlockManager(32, 4, hash_fn=lambda parent, tokens, extra: 42)  # every block collides
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.commit("a", 5)
    assert bm.allocate("b", [9, 9, 9, 9, 5]) == 0
    assert set(bm.block_table("a")).isdisjoint(bm.block_table("b"))
    assert bm.allocate("c", [1, 2, 3, 4, 6]) == 4  # same tokens still hit


def test_full_prefix_hit_recomputes_last_token():
    bm = BlockManager(16, 4)
    bm.allocate("a", list(range(8)))
    bm.commit("a", 8)
    assert bm.allocate("b", list(range(8))) == 4  # never a zero-length query


def test_blocks_are_not_published_before_their_kv_is_computed():
    bm = BlockManager(16, 4)
    bm.allocate("a", list(range(8)))
    assert bm.allocate("b", list(range(9))) == 0  # a's KV not committed yet: no hit
    bm.commit("a", 4)
    assert bm.allocate("c", list(range(9))) == 4


def test_extra_keys_separate_prefix_domains():
    bm = BlockManager(16, 4)
    bm.allocate("a", list(range(9)), extra_keys=("lora", "x"))
    bm.commit("a", 9)
    assert bm.allocate("b", list(range(9)), extra_keys=("lora", "y")) == 0
    assert bm.allocate("c", list(range(9)), extra_keys=("lora", "x")) == 8


def test_freed_blocks_stay_cached_and_oldest_are_evicted_first():
    bm = BlockManager(5, 2)  # 4 usable blocks
    bm.allocate("a", [1, 2, 3])
    bm.commit("a", 3)
    bm.free("a")
    assert bm.stats().cached_blocks == 1 and bm.num_free_blocks == 4
    assert bm.allocate("b", [1, 2, 9]) == 2  # revived from the free queue
    bm.free("b")
    bm.allocate("c", [5, 6, 7])
    bm.commit("c", 3)
    bm.free("c")
    # Filling the pool evicts a's older prefix before c's newer one.
    bm.allocate("d", [0] * 5)
    bm.free("d")
    assert bm.allocate("e", [5, 6, 1]) == 2
    assert bm.allocate("f", [1, 2, 1]) == 0


def test_fresh_blocks_of_a_table_lie_in_ascending_order_after_cached_tables_come_back():
    bm = BlockManager(9, 2)  # 8 usable blocks
    bm.allocate("a", list(range(8)))
    bm.commit("a", 8)
    bm.free("a")  # cached blocks go back tail first: the queue holds 5..8, then 4, 3, 2, 1
    bm.allocate("b", list(range(100, 114)))
    assert bm.block_table("b") == [2, 3, 4, 5, 6, 7, 8]  # taken as 5..8, 4, 3, 2: laid out front to back
    bm.append_slots("b", [200, 201])  # the block a step grows by comes from the queue's front, as before
    assert bm.block_table("b")[-1] == 1
    bm.free("b")
    assert bm.num_free_blocks == 8


def test_fork_shares_blocks_and_append_copies_a_shared_last_block():
    bm = BlockManager(16, 4)
    bm.allocate("p", [1, 2, 3, 4, 5, 6])
    bm.fork("p", "c")
    assert bm.block_table("p") == bm.block_table("c")
    assert bm.stats().used_blocks == 2
    copies = bm.append_slots("c", [7])
    assert copies == [(bm.block_table("p")[1], bm.block_table("c")[1])]
    assert bm.block_table("p")[0] == bm.block_table("c")[0]
    assert bm.append_slots("p", [8]) == []  # p's block is exclusive again


def test_append_at_block_boundary_needs_no_copy():
    bm = BlockManager(16, 4)
    bm.allocate("p", [1, 2, 3, 4])
    bm.fork("p", "c")
    assert bm.append_slots("c", [5]) == []
    assert bm.blocks[bm.block_table("c")[0]].ref_count == 2


def test_truncate_releases_tail_blocks_and_unpublishes_rewritten_block():
    bm = BlockManager(16, 4)
    bm.allocate("a", list(range(10)))
    bm.commit("a", 10)
    bm.truncate("a", 6)
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 13
    bm.append_slots("a", [99])  # overwrites position 6 of a published block: it must leave the cache
    assert bm.blocks[bm.block_table("a")[1]].hash is None
    bm.free("a")
    assert bm.allocate("b", list(range(10))) == 4


def test_watermark_keeps_blocks_free_at_admission_only():
    bm = BlockManager(11, 4, watermark=0.2)  # 10 usable, keep 2 free when admitting
    assert bm.can_allocate(list(range(32)))
    assert not bm.can_allocate(list(range(33)))
    bm.allocate("a", list(range(32)))
    assert bm.can_append("a", 8)


def test_out_of_blocks_says_what_to_change_and_changes_nothing():
    bm = BlockManager(4, 4)
    with pytest.raises(OutOfBlocks, match="raise num_blocks"):
        bm.allocate("a", list(range(20)))
    assert bm.num_free_blocks == 3 and not bm.has("a")
    bm.allocate("b", list(range(12)))
    with pytest.raises(OutOfBlocks, match="preempt"):
        bm.append_slots("b", [1])


@pytest.mark.parametrize("bad", [0, 3, 512])
def test_block_size_must_be_a_power_of_two_up_to_256(bad):
    with pytest.raises(InvalidRequest, match="power of two"):
        BlockManager(8, bad)


def test_block_size_one_is_token_attention():
    bm = BlockManager(8, 1)
    bm.allocate("a", [1, 2, 3])
    assert bm.slot_mapping("a", 0, 3) == [b for b in bm.block_table("a")]
    assert bm.stats().waste_pct == 0.0


def test_stats_report_waste_of_partially_filled_last_blocks():
    bm = BlockManager(16, 16)
    bm.allocate("a", list(range(20)))  # 2 blocks, 32 slots, 20 used
    stats = bm.stats()
    assert stats.used_blocks == 2 and stats.tokens_stored == 20
    assert stats.waste_pct == pytest.approx(100 * 12 / 32)


def test_swap_out_frees_gpu_blocks_and_swap_in_restores_the_table_length():
    bm = BlockManager(8, 4, num_cpu_blocks=4)
    bm.allocate("a", list(range(7)))
    bm.fork("a", "b")
    pairs = bm.swap_out(["a", "b"])
    assert len(pairs) == 2  # shared blocks are moved once for the group
    assert bm.num_free_blocks == 7
    with pytest.raises(InvalidRequest, match="swap it in"):
        bm.append_slots("a", [1])
    back = bm.swap_in(["a", "b"])
    assert len(back) == 2 and bm.block_table("a") == bm.block_table("b")
    assert bm.stats().cpu_blocks_used == 0


def test_a_swapped_out_sequence_holding_cpu_ids_past_the_pool_counts_the_blocks_it_will_need():
    bm = BlockManager(3, 4, num_cpu_blocks=8)  # 2 device blocks, 8 CPU blocks
    for seq_id in ("a", "b"):
        bm.allocate(seq_id, list(range(5)))
        bm.swap_out([seq_id])
    assert max(bm.block_table("b")) >= bm.num_blocks  # CPU ids the device pool does not have
    assert bm.blocks_to_append("b", 1) == 0 and bm.blocks_to_append("b", 4) == 1
    bm.swap_in(["b"])
    assert bm.blocks_to_append("b", 4) == 1


def test_swap_out_without_swap_space_says_to_raise_it():
    bm = BlockManager(8, 4)
    bm.allocate("a", [1, 2, 3])
    with pytest.raises(OutOfBlocks, match="swap-space"):
        bm.swap_out(["a"])


def test_double_allocation_and_empty_sequences_are_rejected():
    bm = BlockManager(8, 4)
    bm.allocate("a", [1])
    with pytest.raises(InvalidRequest, match="already has blocks"):
        bm.allocate("a", [1])
    with pytest.raises(InvalidRequest, match="empty"):
        bm.allocate("b", [])
