"""Sliding-window layers in their own block groups: outputs stay HF's, windowed groups stay bounded, blocks drain.

Tiny models (2 layers, window 6 or 8, block size 4) so windows slide many times within a short generation:
Mistral (every layer windowed: one windowed group), Gemma 2 / Gemma 3 (one windowed and one full layer: two
groups) and Qwen2 with use_sliding_window (layers from max_window_layers on are windowed).
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from _engine_helpers import make_llm_fixture  # noqa: F401
from _hf_models import tiny_model

from paged_backend.core.kv_cache import PagedKVCache
from paged_backend.core.kv_groups import KVCacheGroup, kv_cache_groups
from paged_backend.engine import LLM, SamplingParams
from paged_backend.errors import InvalidRequest
from paged_backend.hf import PagedCache

WINDOWED = {
    "mistral": {},
    "gemma2": {},
    "gemma3": {},
    "qwen2": dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
}
NEW_TOKENS = 16


@cache
def reference(arch: str, **overrides):
    attention = "eager" if arch == "gemma2" else "sdpa"  # transformers has no sdpa path for Gemma2
    return tiny_model(arch, attention, seed=3, **{**WINDOWED[arch], **overrides})


@cache
@torch.no_grad()
def hf_greedy(arch: str, prompt: tuple[int, ...], new_tokens: int = NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    out = reference(arch).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                   do_sample=False, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (int(n),), generator=g).tolist() for n in torch.randint(2, 23, (count,), generator=g)]


@pytest.fixture(name="windowed_llm")
def windowed_llm_fixture(make_llm):
    """make_llm over the windowed tiny models (every block must be free again afterwards)."""

    def build(arch: str, sliding_window: int | None = None, **kwargs) -> LLM:
        model = reference(arch, sliding_window=sliding_window) if sliding_window else reference(arch)
        return make_llm(model=model, **{"num_blocks": 96, **kwargs})

    return build


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def assert_matches_hf(arch, outputs, batch):
    for out, prompt in zip(outputs, batch, strict=True):
        for completion in out.outputs:
            assert completion.token_ids == hf_greedy(arch, tuple(prompt)), prompt


@pytest.mark.parametrize("arch", sorted(WINDOWED))
def test_windowed_models_match_hf_with_prefix_hits_and_parallel_samples(arch, windowed_llm):
    llm = windowed_llm(arch)
    groups = llm.engine.kv_cache.groups
    assert [g.sliding_window for g in groups] == {"mistral": [6]}.get(arch, [None, 6])
    shared = prompts(1, seed=9)[0] * 2  # 2 x (2..22) tokens: prefixes longer than the window
    batch = prompts(6) + [shared + [5, 6, 7], shared + [8]]
    assert_matches_hf(arch, llm.generate(batch, GREEDY), batch)
    # Again, with n=2: prompts now hit the prefix cache in every group, siblings fork every group's blocks.
    outputs = llm.generate(batch, SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert_matches_hf(arch, outputs, batch)
    assert llm.engine.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_windowed_models_match_hf_under_preemption(arch, mode, windowed_llm):
    # Just room for the longest sequence (22 + 16 tokens) in every group: sequences must take turns.
    num_blocks = {"mistral": 12, "gemma3": 22}[arch]
    llm = windowed_llm(arch, num_blocks=num_blocks, swap_space=0.01 if mode == "swap" else 0, preemption_mode=mode)
    batch = prompts(8, seed=1)
    # Windowed sequences stop growing, so all-windowed Mistral needs forks (copy-on-write growth) to run short.
    params = SamplingParams(n=3 if arch == "mistral" else 1, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert_matches_hf(arch, llm.generate(batch, params), batch)
    assert llm.engine.stats().num_preemptions > 0


def test_windowed_groups_stay_bounded_while_the_full_group_grows(windowed_llm):
    window, block_size = 8, 4
    engine = windowed_llm("gemma3", num_blocks=128, block_size=block_size, sliding_window=window).engine
    assert engine.block_manager.sliding_windows == (None, window)
    engine.add_request("a", None, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True),
                       prompt_token_ids=list(range(3, 30)))  # fmt: skip
    full_seen, manager = [], engine.block_manager
    while engine.has_unfinished_requests():
        engine.step()
        request = engine.requests.get("a")
        if request is None:
            break
        seq = request.seqs[0]
        full, windowed = manager.num_blocks_held(seq.seq_id)
        assert windowed <= window // block_size + 1
        assert full == -(-manager.num_tokens(seq.seq_id) // block_size)
        full_seen.append(full)
        stats = manager.stats()
        assert stats.groups[1].used_blocks == windowed and stats.groups[0].used_blocks == full
    assert full_seen[-1] >= 25 and full_seen[-1] > 8 * (window // block_size + 1)


def test_every_layer_windowed_holds_a_bounded_number_of_blocks(windowed_llm):
    llm = windowed_llm("mistral", block_size=4)
    engine, manager = llm.engine, llm.engine.block_manager
    engine.add_request("a", None, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                       prompt_token_ids=list(range(3, 10)))  # fmt: skip
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, manager.num_used_blocks)
    assert peak <= 6 // 4 + 2  # window/block_size + 1, and one more while the window straddles blocks


def test_a_max_model_len_the_pool_cannot_hold_is_refused_at_startup(windowed_llm):
    # Gemma 3 style: the full group holds every token, the windowed one 2 blocks: 11 usable blocks hold 9 x 16.
    with pytest.raises(InvalidRequest, match=r"max_model_len=400 .* at most 144 tokens"):
        windowed_llm("gemma3", num_blocks=12, block_size=16, max_model_len=400, watermark=0.0)
    with pytest.raises(InvalidRequest, match="lower max_model_len to 144"):
        windowed_llm("gemma3", num_blocks=12, block_size=16, max_model_len=145, watermark=0.0)
    assert windowed_llm("gemma3", num_blocks=12, block_size=16, watermark=0.0).engine.max_model_len == 144
    # Windowed everywhere: the pool bounds a sequence's blocks, not its length (the model's positions do).
    mistral = windowed_llm("mistral", num_blocks=12, block_size=16, max_model_len=200).engine
    assert mistral.max_model_len == 200
    unchunked = windowed_llm("mistral", num_blocks=12, block_size=16, enable_chunked_prefill=False).engine
    assert unchunked.max_model_len == 176  # a recompute re-prefills whole: the pool bounds it again


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_every_layer_windowed_grows_past_the_pool(mode, windowed_llm):
    # 5 usable blocks of 4 tokens hold 20 tokens; prompts of 30-40 tokens generate 60 more, in chunks that fit.
    llm = windowed_llm("mistral", num_blocks=6, block_size=4, watermark=0.0, preemption_mode=mode,
                       swap_space=0.01 if mode == "swap" else 0)  # fmt: skip
    engine, manager = llm.engine, llm.engine.block_manager
    assert engine.max_model_len == 256 and engine.scheduler.max_chunk == 11
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (40, 30)]
    new_tokens = 60
    for prompt in batch:
        engine.add_request(str(len(prompt)), None, SamplingParams(temperature=0, max_tokens=new_tokens,
                                                                  ignore_eos=True), prompt_token_ids=prompt)  # fmt: skip
    outputs, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        peak = max(peak, manager.num_used_blocks)
        for request in engine.requests.values():
            for seq in request.seqs:
                if manager.has(seq.seq_id) and not manager.seqs[seq.seq_id].on_cpu:
                    assert manager.num_blocks_held(seq.seq_id)[0] <= 6 // 4 + 2  # the window, never the sequence
    assert peak <= 5 and engine.stats().num_preemptions > 0  # both cannot run at once: they took turns
    for prompt in batch:
        assert outputs[str(len(prompt))] == hf_greedy("mistral", tuple(prompt), new_tokens), len(prompt)


@pytest.mark.parametrize("attn", ["sdpa", "paged_backend"])
def test_qwen2_sliding_window_through_paged_cache(attn):
    model = reference("qwen2")
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    ids = torch.tensor([prompts(1, seed=4)[0] * 2])
    want = model.generate(ids, max_new_tokens=30, do_sample=False)
    cache = PagedCache(model, num_blocks=64, block_size=4)
    try:
        model.set_attn_implementation(attn)
        got = model.generate(ids, max_new_tokens=30, do_sample=False, past_key_values=cache)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(got, want)
    full, windowed = cache.stats().blocks.groups
    assert windowed.used_blocks <= 6 // 4 + 2 < full.used_blocks
    cache.reset()
    assert cache.stats().free_blocks == cache.stats().total_blocks


def test_layer_groups_have_equal_sizes_and_share_one_pool_of_block_ids():
    gemma3 = [4, 4, 4, 4, 4, None] * 2  # Gemma 3's 5:1 pattern: 2 full layers, 10 windowed ones
    groups = kv_cache_groups(gemma3)
    assert [(g.layers, g.sliding_window) for g in groups] == [
        ((5, 11), None), ((0, 1), 4), ((2, 3), 4), ((4, 6), 4), ((7, 8), 4), ((9, 10), 4)
    ]  # fmt: skip
    assert kv_cache_groups([None] * 3) == [KVCacheGroup((0, 1, 2), None)]  # no window: today's single group
    cache = PagedKVCache(12, 2, 8, num_blocks=10, block_size=4, dtype=torch.float32, groups=groups)
    assert cache.kv.shape[0] == 2 and cache.bytes_per_block == 2 * 2 * 4 * 2 * 8 * 4  # two layers a block
    assert cache.layer(11)[0].data_ptr() == cache.layer(1)[0].data_ptr()  # same slot, told apart by block id
    assert cache.layer_group[11] == 0 and cache.layer_group[1] == 1
