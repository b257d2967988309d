"""Greedy engine outputs equal HF generate, whatever the batching, preemption, chunking or prefix caching."""

import pytest
from _engine_helpers import MAX_TOKENS, hf_greedy, make_llm_fixture, ragged_prompts  # noqa: F401

from paged_backend.engine import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def assert_matches_hf(arch, prompts, outputs):
    assert [o.prompt_token_ids for o in outputs] == prompts  # input order kept
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.finished
        assert output.outputs[0].token_ids == hf_greedy(arch, prompt)


@pytest.mark.parametrize("backend", ["cpu", "torch"])  # the fused kernel (auto on CPU) and the oracle
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_batch_matches_hf_generate(arch, backend, make_llm):
    prompts = ragged_prompts()
    llm = make_llm(arch, attention_backend=backend)
    assert_matches_hf(arch, prompts, llm.generate(prompts, GREEDY))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_under_recompute_preemption_matches_hf(arch, make_llm):
    prompts = ragged_prompts()
    llm = make_llm(arch, num_blocks=40, watermark=0.0)
    assert_matches_hf(arch, prompts, llm.generate(prompts, GREEDY))
    assert llm.engine.stats().num_preemptions > 0


def test_greedy_under_swap_preemption_matches_hf(make_llm):
    prompts = ragged_prompts()
    llm = make_llm(num_blocks=40, watermark=0.0, swap_space=0.01)
    assert llm.engine.scheduler.preemption_mode == "swap"
    assert_matches_hf("llama", prompts, llm.generate(prompts, GREEDY))
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.block_manager.stats().cpu_blocks_used == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_chunked_prefill_splits_long_prompts_and_matches_hf(arch, make_llm):
    prompts = ragged_prompts()
    llm = make_llm(arch, max_num_batched_tokens=16)
    assert_matches_hf(arch, prompts, llm.generate(prompts, GREEDY))
    assert llm.engine.stats().num_split_prefills > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shared_system_prompt_hits_prefix_cache_and_matches_hf(arch, make_llm):
    system = list(range(30, 54))
    prompts = ragged_prompts(16, seed=1, longest=12, prefix=system)
    llm = make_llm(arch, max_num_seqs=4)
    assert_matches_hf(arch, prompts, llm.generate(prompts, GREEDY))
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_hit_rate > 0.3


def test_prefix_caching_off_has_no_hits(make_llm):
    prompts = ragged_prompts(4, prefix=list(range(30, 54)))
    llm = make_llm(enable_prefix_caching=False)
    assert_matches_hf("llama", prompts, llm.generate(prompts, GREEDY))
    assert llm.engine.stats().prefix_cache_hits == 0


def test_decodes_are_scheduled_before_prefill_chunks(make_llm):
    llm = make_llm(max_num_batched_tokens=8)
    engine = llm.engine
    engine.add_request("short", None, GREEDY, prompt_token_ids=[1, 2, 3])
    engine.step()
    engine.add_request("long", None, GREEDY, prompt_token_ids=list(range(40)))
    for _ in range(3):
        plan_tokens = {out.request_id for out in engine.step()}
        assert "short" in plan_tokens  # the decode advances every step while the long prompt is chunked
    while engine.has_unfinished_requests():
        engine.step()
