"""PagedCache stores what generate repeats only once: expanded prompts, beams, forks of a filled cache."""

from __future__ import annotations

import pytest
import torch
from _hf_models import prompts, tiny_model
from transformers import DynamicCache

from paged_backend.hf import PagedCache

PROMPT_LEN, BLOCK = 512, 16
PROMPT_BLOCKS = PROMPT_LEN // BLOCK


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", max_position_embeddings=1024)


def long_prompt() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 128, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def seeded_generate(model, **kwargs):
    torch.manual_seed(0)
    return model.generate(**kwargs)


def assert_all_blocks_free_after_reset(cache: PagedCache) -> None:
    cache.reset()
    stats = cache.stats()
    assert stats.used_blocks == 0 and stats.free_blocks == stats.total_blocks


@pytest.mark.parametrize("attn", ["sdpa", "paged_backend"])
def test_sampled_sequences_store_the_prompt_once(llama, attn):
    llama.set_attn_implementation(attn)
    cache = PagedCache(llama, max_tokens=4 * PROMPT_LEN, block_size=BLOCK)
    kwargs = dict(**long_prompt(), do_sample=True, num_return_sequences=8)
    seeded_generate(llama, **kwargs, max_new_tokens=1, past_key_values=cache)
    stats = cache.stats()
    assert stats.used_blocks == PROMPT_BLOCKS  # not 8 x 32
    assert stats.shared_blocks == PROMPT_BLOCKS
    assert stats.blocks_saved_by_sharing == 7 * PROMPT_BLOCKS
    assert stats.saved_bytes == 7 * PROMPT_BLOCKS * cache.kv_cache.bytes_per_block
    assert_all_blocks_free_after_reset(cache)

    tokens = seeded_generate(llama, **kwargs, max_new_tokens=3, past_key_values=cache)
    assert cache.stats().used_blocks == PROMPT_BLOCKS + 8  # each row's own tokens start a new block
    llama.set_attn_implementation("sdpa")
    assert torch.equal(tokens, seeded_generate(llama, **kwargs, max_new_tokens=3))
    assert_all_blocks_free_after_reset(cache)


@pytest.mark.parametrize("prefill_chunk_size", [None, 128], ids=["one_prefill", "chunked_prefill"])
def test_beams_store_the_prompt_once(llama, prefill_chunk_size):
    llama.set_attn_implementation("sdpa")
    cache = PagedCache(llama, max_tokens=4 * PROMPT_LEN, block_size=BLOCK)
    kwargs = dict(**long_prompt(), num_beams=8, do_sample=False, output_scores=True, return_dict_in_generate=True,
                  prefill_chunk_size=prefill_chunk_size)
    llama.generate(**kwargs, max_new_tokens=1, past_key_values=cache)
    assert cache.stats().used_blocks == PROMPT_BLOCKS
    assert cache.stats().shared_blocks == PROMPT_BLOCKS
    assert_all_blocks_free_after_reset(cache)

    out = llama.generate(**kwargs, max_new_tokens=3, past_key_values=cache)
    assert cache.stats().peak_used_blocks <= PROMPT_BLOCKS + 8
    want = llama.generate(**kwargs, max_new_tokens=3)
    assert torch.equal(out.sequences, want.sequences)
    assert torch.equal(out.sequences_scores, want.sequences_scores)
    assert_all_blocks_free_after_reset(cache)


def test_shared_partial_block_is_copied_before_a_row_writes_it():
    model = tiny_model("llama")
    cache = PagedCache(model, max_tokens=256, block_size=4)
    kwargs = dict(**prompts(padded=False, rows=1, width=10), do_sample=True, num_return_sequences=3)
    tokens = seeded_generate(model, **kwargs, max_new_tokens=2, past_key_values=cache)
    # 10 prompt tokens: 2 full shared blocks + 1 partial; two rows copy the partial one, the third keeps it.
    assert cache.stats().used_blocks == 3 + 2
    assert cache.stats().shared_blocks == 2
    assert torch.equal(tokens, seeded_generate(model, **kwargs, max_new_tokens=2))
    assert_all_blocks_free_after_reset(cache)


@torch.no_grad()
def test_beam_reorder_permutes_block_tables_without_copying_kv():
    model = tiny_model("llama")
    cache = PagedCache(model, max_tokens=256, block_size=4)
    model(**prompts(padded=False, rows=2), past_key_values=cache)
    tables = [list(cache.block_manager.block_table(seq)) for seq in cache.rows.seqs]
    pool_before = cache.kv_cache.kv.clone()
    cache.reorder_cache(torch.tensor([1, 1]))
    assert [cache.block_manager.block_table(seq) for seq in cache.rows.seqs] == [tables[1], tables[1]]
    assert torch.equal(cache.kv_cache.kv, pool_before)
    assert cache.stats().used_blocks == len(tables[1])  # row 0's blocks went back to the free queue
    assert_all_blocks_free_after_reset(cache)


@pytest.mark.parametrize("attn", ["sdpa", "eager", "paged_backend"])
def test_second_generate_continues_from_the_filled_cache(attn):
    model = tiny_model("llama")
    inputs = prompts(padded=True)

    def two_calls(cache, attn_implementation):
        model.set_attn_implementation(attn_implementation)
        first = model.generate(**inputs, max_new_tokens=4, do_sample=False, past_key_values=cache)
        mask = torch.cat([inputs["attention_mask"], torch.ones(2, 4, dtype=torch.long)], dim=1)
        return model.generate(input_ids=first, attention_mask=mask, max_new_tokens=4, do_sample=False,
                              past_key_values=cache)

    cache = PagedCache(model, max_tokens=256, block_size=4)
    want = two_calls(DynamicCache(config=model.config), "sdpa" if attn == "paged_backend" else attn)
    assert torch.equal(two_calls(cache, attn), want)
    assert_all_blocks_free_after_reset(cache)


@pytest.mark.parametrize("attn", ["sdpa", "paged_backend"])
def test_beams_continuing_a_filled_cache_fork_its_rows(attn):
    """transformers does not expand a filled cache for beams (DynamicCache fails); PagedCache forks the rows."""
    model = tiny_model("llama")
    model.set_attn_implementation(attn)
    inputs = prompts(padded=True)
    cache = PagedCache(model, max_tokens=512, block_size=4)
    first = model.generate(**inputs, max_new_tokens=4, do_sample=False, past_key_values=cache)
    mask = torch.cat([inputs["attention_mask"], torch.ones(2, 4, dtype=torch.long)], dim=1)
    beams = dict(input_ids=first, attention_mask=mask, max_new_tokens=4, num_beams=3, num_return_sequences=2,
                 do_sample=False, output_scores=True, return_dict_in_generate=True)
    out = model.generate(**beams, past_key_values=cache)
    model.set_attn_implementation("sdpa")
    want = model.generate(**beams)  # whole sequence as the prompt, no cache reuse
    assert torch.equal(out.sequences, want.sequences)
    torch.testing.assert_close(out.sequences_scores, want.sequences_scores, rtol=0, atol=1e-5)
    assert_all_blocks_free_after_reset(cache)


@torch.no_grad()
def test_paged_attention_never_stores_padding():
    model = tiny_model("llama", "paged_backend")
    inputs = prompts(padded=True, rows=2, width=9)  # 7 and 5 real tokens
    cache = PagedCache(model, max_tokens=256, block_size=4)
    model.generate(**inputs, max_new_tokens=1, past_key_values=cache)
    assert cache.stats().blocks.tokens_stored == 7 + 5
    assert cache.get_seq_length() == 9  # transformers still counts the padding columns
    assert_all_blocks_free_after_reset(cache)


@torch.no_grad()
def test_rows_that_diverge_after_layer_zero_get_their_own_blocks():
    """Same ids and positions, different masks: the first layer's K/V match, the second's do not."""
    model = tiny_model("llama")
    ids, positions = torch.tensor([[5, 6], [5, 6], [5, 6]]), torch.tensor([[0, 1]] * 3)
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    cache = PagedCache(model, max_tokens=64, block_size=4)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
    want = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=DynamicCache())
    assert torch.equal(out.logits, want.logits)
    assert cache.stats().used_blocks == 2  # rows 0 and 1 share; row 2 was split off
    next_mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
    step = dict(input_ids=torch.tensor([[7]] * 3), attention_mask=next_mask, position_ids=torch.tensor([[2]] * 3))
    paged_logits = model(**step, past_key_values=cache).logits
    assert torch.equal(paged_logits, model(**step, past_key_values=want.past_key_values).logits)
    assert_all_blocks_free_after_reset(cache)
