"""PagedKVCache: sizing, layout, block copies and swaps move the right bytes."""

import gc
import re
from pathlib import Path

import pytest
import torch

from paged_backend import BlockManager, InvalidRequest, PagedKVCache
from paged_backend.core import huge_pages
from paged_backend.core.kv_budget import bytes_per_block, num_blocks_for_budget
from paged_backend.core.kv_cache import pool_zeros, resolve_kv_dtype
from paged_backend.ops import reshape_and_cache


def make_cache(**kw):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=10, block_size=4, dtype=torch.float32)
    args.update(kw)
    return PagedKVCache(**args)


def test_layout_is_nhd_per_layer_and_bytes_add_up():
    cache = make_cache()
    key_cache, value_cache = cache.layer(1)
    assert key_cache.shape == value_cache.shape == (10, 4, 2, 8)
    assert cache.bytes_per_block == 2 * 2 * 4 * 2 * 8 * 4
    assert cache.total_bytes == 10 * cache.bytes_per_block


def test_budget_sizing_in_bytes_and_rejects_a_budget_below_two_blocks():
    per_block = bytes_per_block(4, 8, 128, 16, torch.float16)
    assert num_blocks_for_budget(4, 8, 128, 16, torch.float16, memory_bytes=10 * per_block + 5) == 10
    with pytest.raises(InvalidRequest, match="raise the budget"):
        num_blocks_for_budget(4, 8, 128, 16, torch.float16, memory_bytes=per_block)
    assert num_blocks_for_budget(1, 1, 8, 1, torch.float32, memory_fraction=1e-6) >= 2


def test_unknown_kv_dtype_names_the_choices():
    assert resolve_kv_dtype("auto", torch.bfloat16) is torch.bfloat16
    with pytest.raises(InvalidRequest, match="fp8"):
        resolve_kv_dtype("int3", torch.float16)


def test_copy_on_write_copies_the_block_in_every_layer():
    cache = make_cache()
    bm = BlockManager(10, 4)
    bm.allocate("p", [1, 2, 3, 4, 5])
    keys = torch.randn(5, 2, 8)
    for layer in range(2):
        reshape_and_cache(keys, -keys, *cache.layer(layer), torch.tensor(bm.slot_mapping("p", 0, 5)))
    bm.fork("p", "c")
    copies = bm.append_slots("c", [6])
    cache.copy_blocks(copies)
    src, dst = copies[0]
    for layer in range(2):
        key_cache, value_cache = cache.layer(layer)
        assert torch.equal(key_cache[dst], key_cache[src]) and torch.equal(value_cache[dst], -key_cache[src])


def test_swap_out_and_in_round_trips_the_bytes():
    cache = make_cache(num_cpu_blocks=4)
    bm = BlockManager(10, 4, num_cpu_blocks=4)
    bm.allocate("a", list(range(6)))
    keys = torch.randn(6, 2, 8)
    reshape_and_cache(keys, keys, *cache.layer(0), torch.tensor(bm.slot_mapping("a", 0, 6)))
    cache.swap_out(bm.swap_out(["a"]))
    cache.kv.zero_()  # the GPU blocks get reused by someone else
    cache.swap_in(bm.swap_in(["a"]))
    slots = torch.tensor(bm.slot_mapping("a", 0, 6))
    assert torch.equal(cache.layer(0)[0].view(-1, 2, 8)[slots], keys)


def test_swap_without_cpu_pool_says_what_to_change():
    with pytest.raises(InvalidRequest, match="num_cpu_blocks"):
        make_cache().swap_out([(1, 0)])


def test_fp8_pool_stores_scaled_values_and_copies_bytes():
    cache = make_cache(dtype=torch.float8_e4m3fn)
    keys = torch.tensor([0.5, -1.0, 2.0, 0.25]).repeat(2, 2, 2)  # [2, 2, 8], exactly representable
    reshape_and_cache(keys, keys, *cache.layer(0), torch.tensor([4, 5]), k_scale=0.5, v_scale=1.0)
    key_cache, value_cache = cache.layer(0)
    assert torch.equal(key_cache[1, :2].float() * 0.5, keys)
    assert torch.equal(value_cache[1, :2].float(), keys)
    cache.copy_blocks([(1, 2)])
    assert torch.equal(key_cache[2].float(), key_cache[1].float())


def mapping_of(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps entry (its header as 'range', then its fields) of the mapping holding `address`."""
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        lo, hi = (int(bound, 16) for bound in entry.split()[0].split("-"))
        if lo <= address < hi:
            lines = entry.splitlines()
            return {"range": lines[0], **dict(line.split(":", 1) for line in lines[1:] if ":" in line)}
    return None


@pytest.mark.skipif(not huge_pages.huge_pages_offered(), reason="this kernel's transparent huge pages are off")
def test_a_cpu_pool_lies_on_huge_pages_zeroed_and_unmaps_with_its_cache(monkeypatch):
    monkeypatch.setenv(huge_pages.SWITCH, "1")
    cache = make_cache(num_layers=2, num_kv_heads=8, head_dim=128, num_blocks=256, block_size=16,
                       dtype=torch.bfloat16)  # fmt: skip
    pool = cache.kv
    assert pool.data_ptr() % huge_pages.HUGE_PAGE == 0 and not pool.any()
    mapping = mapping_of(pool.data_ptr())
    assert int(mapping["AnonHugePages"].split()[0]) * 1024 >= cache.total_bytes  # every byte on 2 MiB pages
    keys = torch.randn(16, 8, 128).to(torch.bfloat16)
    reshape_and_cache(keys, keys, *cache.layer(1), torch.arange(16, 32))
    cache.copy_blocks([(1, 5)])
    assert torch.equal(cache.layer(1)[0][5], keys)
    address = pool.data_ptr()
    del pool, mapping
    cache.release()
    gc.collect()
    assert mapping_of(address) is None  # the memory went back with the last view


def test_pools_take_plain_zeros_unless_asked_and_a_bad_switch_names_its_values(monkeypatch):
    def refuse(*args):
        raise AssertionError("huge pages without PAGED_BACKEND_KV_HUGE_PAGES=1")

    monkeypatch.setattr(huge_pages, "zeros", refuse)
    monkeypatch.delenv(huge_pages.SWITCH, raising=False)
    assert not make_cache(num_kv_heads=8, head_dim=128, num_blocks=256, block_size=16).kv.any()
    monkeypatch.setenv(huge_pages.SWITCH, "maybe")
    with pytest.raises(InvalidRequest, match="PAGED_BACKEND_KV_HUGE_PAGES='maybe' is not a boolean: set it to 1 or 0"):
        make_cache()


def test_small_pools_and_other_devices_take_plain_zeros():
    tensor = huge_pages.zeros((4, 4), torch.float32)
    assert tensor.shape == (4, 4) and not tensor.any()
    assert pool_zeros((2, 3), torch.float16, torch.device("meta")).device.type == "meta"
