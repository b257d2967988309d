"""PagedCache refuses what it cannot do exactly, with a sentence saying what to change."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from _hf_models import prompts, tiny_model
from transformers import AttentionInterface, BartConfig, LlamaConfig

from paged_backend import InvalidRequest, OutOfBlocks, UnsupportedModel
from paged_backend.core.kv_budget import available_memory, kv_memory_bytes
from paged_backend.hf import PagedCache
from paged_backend.hf.layer_handle import PagedLayerKV


def llama_config(**overrides) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, **overrides)


def test_import_registers_the_paged_backend_attention():
    assert "paged_backend" in AttentionInterface._global_mapping
    model = tiny_model("llama", "paged_backend")
    assert model.config._attn_implementation == "paged_backend"


@pytest.mark.parametrize(
    ("config", "feature"),
    [
        (BartConfig(d_model=64, encoder_layers=1, decoder_layers=1), "cross-attention"),
        (llama_config(layer_types=["full_attention", "linear_attention"]), "linear_attention"),
        (llama_config(attention_chunk_size=8), "chunked_attention"),
    ],
    ids=["encoder_decoder", "linear_attention", "chunked_attention"],
)
def test_unsupported_architectures_name_the_feature(config, feature):
    with pytest.raises(UnsupportedModel, match=feature):
        PagedCache(config, max_tokens=64)


def test_model_code_that_touches_the_handle_is_unsupported():
    handle = PagedLayerKV(None, 0, torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))
    with pytest.raises(UnsupportedModel, match="shape"):
        _ = handle.shape
    with pytest.raises(UnsupportedModel, match="cat"):
        torch.cat([handle, handle])


def test_keys_of_another_width_than_the_config_are_unsupported():
    cache = PagedCache(llama_config(), max_tokens=64)
    with pytest.raises(UnsupportedModel, match="head sizes"):
        cache.update(torch.zeros(1, 2, 3, 32), torch.zeros(1, 2, 3, 32), 0)


@pytest.mark.parametrize("attn", ["sdpa", "paged_backend"])
def test_a_cache_of_fewer_layers_than_the_model_says_it_was_built_for_another_config(attn):
    """The message said the model's config declared 2 layers; the 2 were the cache's config's, the model has 4."""
    cache = PagedCache(tiny_model("llama", attn), max_tokens=256)
    with pytest.raises(UnsupportedModel, match=r"built for a config with 2 layers, but the model has more.*"
                                               r"PagedCache\(model"):  # fmt: skip
        tiny_model("llama", attn, num_hidden_layers=4).generate(
            **prompts(padded=True), max_new_tokens=2, do_sample=False, past_key_values=cache
        )


@pytest.mark.parametrize(
    "dtype",
    [torch.int32, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fnuz, torch.float8_e8m0fnu, "float16"],
)
def test_a_pool_dtype_that_cannot_hold_keys_is_refused(dtype):
    """Under sdpa an integer pool ran, rounding every key, and fp8 formats the pool ops do not scale were cast
    unscaled: tokens differed from DynamicCache's, silently. The message lists the dtypes that work."""
    with pytest.raises(InvalidRequest, match=rf"PagedCache\(dtype={dtype!r}\) cannot hold keys and values; pass "
                                             r"dtype= one of torch.float16, .*torch.float8_e4m3fn"):  # fmt: skip
        PagedCache(llama_config(), max_tokens=64, dtype=dtype)


def test_a_model_dtype_the_pool_cannot_hold_is_named_as_the_models():
    """Without dtype= the pool takes the model's dtype; the message must not claim the user passed one."""
    with pytest.raises(InvalidRequest, match=r"^the model's dtype torch.int8 cannot hold keys and values; pass dtype="):
        PagedCache(llama_config(dtype="int8"), max_tokens=64)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.float64])
def test_the_pool_dtypes_of_the_engine_still_run(dtype):
    model = tiny_model("llama")
    cache = PagedCache(model, max_tokens=256, dtype=dtype)
    tokens = model.generate(**prompts(padded=True), max_new_tokens=3, do_sample=False, past_key_values=cache)
    assert cache.kv_cache.dtype == dtype and tokens.shape == (2, 12)


@pytest.mark.parametrize(
    "arguments, named",
    [({"block_size": 0}, "block_size=0"), ({"max_tokens": 1.5}, "max_tokens=1.5"), ({"max_tokens": 0}, "max_tokens=0"),
     ({"max_tokens": -1}, "max_tokens=-1"), ({"num_blocks": 0}, "num_blocks=0"), ({"memory_bytes": -5}, "memory_bytes"),
     ({"max_tokens": True}, "max_tokens=True"), ({"block_size": 16.0, "max_tokens": 64}, "block_size=16.0")],
)  # fmt: skip
def test_budget_arguments_out_of_range_name_the_argument_given(arguments, named):
    with pytest.raises(InvalidRequest, match=f"PagedCache\\({named}"):
        PagedCache(llama_config(), **arguments)


def test_budget_arguments_may_be_numpy_integers():
    cache = PagedCache(llama_config(), max_tokens=np.int64(64), block_size=np.int32(16))
    assert cache.kv_cache.num_blocks == 5 and type(cache.kv_cache.block_size) is int


@pytest.mark.parametrize(
    "budget",
    [{"max_tokens": 64, "num_blocks": 8}, {"max_tokens": 64, "num_blocks": 8, "memory_bytes": 1 << 20}],
    ids=["two", "three"],
)
def test_at_most_one_budget(budget):
    with pytest.raises(InvalidRequest, match="one budget at most"):
        PagedCache(llama_config(), **budget)


def test_no_budget_takes_the_default_budget_of_kv_budget():
    """As `DynamicCache()` needs no size, a bare PagedCache sizes its pool by the engine's default rule."""
    model = tiny_model("llama")
    cache = PagedCache(model)
    assert cache.kv_cache.num_blocks == kv_memory_bytes(torch.device("cpu")) // cache.kv_cache.bytes_per_block
    tokens = model.generate(**prompts(padded=True), max_new_tokens=3, do_sample=False, past_key_values=cache)
    assert torch.equal(tokens, model.generate(**prompts(padded=True), max_new_tokens=3, do_sample=False))


def test_the_cpu_budget_counts_the_page_cache_the_kernel_can_drop():
    """Free pages shrink whenever files are read (into the page cache); the default pool must not shrink with
    them, or two starts of the same face would size different pools."""
    with open("/proc/meminfo") as meminfo:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo}
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert available_memory(torch.device("cpu")) >= free
    assert abs(available_memory(torch.device("cpu")) - fields["MemAvailable"]) < 256 << 20


def test_memory_budget_sizes_the_pool():
    cache = PagedCache(llama_config(), memory_bytes=10 * 2 * 2 * 16 * 2 * 16 * 4, block_size=16)
    assert cache.kv_cache.num_blocks == 10
    assert cache.stats().pool_bytes == 10 * cache.kv_cache.bytes_per_block


def test_a_budget_too_small_for_the_prompt_raises_out_of_blocks_and_frees_everything():
    model = tiny_model("llama")
    cache = PagedCache(model, max_tokens=12, block_size=4)  # the first 9-token row fits, the second does not
    with pytest.raises(OutOfBlocks, match="KV memory budget"):
        model.generate(**prompts(padded=False), max_new_tokens=2, past_key_values=cache)
    assert cache.stats().used_blocks == 0 and cache.get_seq_length() == 0


@torch.no_grad()
def test_a_different_batch_on_a_filled_cache_is_refused():
    model = tiny_model("llama")
    cache = PagedCache(model, max_tokens=256)
    model(**prompts(padded=False, rows=2), past_key_values=cache)
    with pytest.raises(InvalidRequest, match="cache.reset"):
        model(**prompts(padded=False, rows=3), past_key_values=cache)


@pytest.mark.parametrize("attn", ["sdpa", "paged_backend"])
def test_a_multiple_of_the_rows_that_does_not_repeat_them_is_refused(attn):
    """A cache filled by one prompt, then generate on two other prompts without reset(): forking row 0 for both
    (as for beams) gave other tokens, silently."""
    model = tiny_model("llama", attn)
    cache = PagedCache(model, max_tokens=256)
    one = prompts(padded=False, rows=1)
    model.generate(**one, past_key_values=cache, max_new_tokens=2, do_sample=False)
    two = {name: torch.cat([value, value.flip(1)]) for name, value in prompts(padded=False, rows=1, width=12).items()}
    with pytest.raises(InvalidRequest, match="does not repeat them.*cache.reset"):
        model.generate(**two, past_key_values=cache, max_new_tokens=2, do_sample=False)
    cache.reset()
    assert cache.stats().used_blocks == 0


@pytest.mark.parametrize(
    ("model_or_config", "device", "said"),
    [
        ("llama", None, "PagedCache takes the transformers model it caches for (or that model's config), got str"),
        (llama_config(), "meta", "PagedCache: device 'meta' cannot hold the pool"),
        (llama_config(), "tpu9", "PagedCache: device 'tpu9' cannot hold the pool"),
    ],
)
def test_what_is_not_a_model_or_a_pool_device_is_named(model_or_config, device, said):
    with pytest.raises(InvalidRequest, match=re.escape(said)):
        PagedCache(model_or_config, max_tokens=64, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_cuda_pool_without_cuda_is_named():
    with pytest.raises(InvalidRequest, match="device 'cuda' cannot hold the pool: .* no CUDA device is available"):
        PagedCache(llama_config(), max_tokens=64, device="cuda")


@torch.no_grad()
def test_switching_attention_on_a_filled_cache_is_refused():
    model = tiny_model("llama")
    cache = PagedCache(model, max_tokens=256)
    model(**prompts(padded=False), past_key_values=cache)
    model.set_attn_implementation("paged_backend")
    with pytest.raises(InvalidRequest, match="cache.reset"):
        model(input_ids=torch.tensor([[5], [6]]), past_key_values=cache)


@torch.no_grad()
def test_paged_attention_needs_the_padding_mask_of_earlier_calls():
    model = tiny_model("llama", "paged_backend")
    cache = PagedCache(model, max_tokens=256)
    inputs = prompts(padded=True)  # 2 and 4 padding columns
    model(**inputs, past_key_values=cache)
    step = dict(input_ids=torch.tensor([[5], [6]]), position_ids=torch.tensor([[7], [5]]), past_key_values=cache)
    with pytest.raises(InvalidRequest, match="full 2D attention_mask"):
        model(**step)
    wrong_past = torch.cat([inputs["attention_mask"], torch.ones(2, 1, dtype=torch.long)], dim=1)
    wrong_past[0, 1] = 1
    with pytest.raises(InvalidRequest, match="past columns"):
        model(**step, attention_mask=wrong_past)
    assert cache.get_seq_length() == 9  # refused calls leave the cache as it was
