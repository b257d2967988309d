"""The engine on a CUDA device: greedy tokens equal HF generate on the same device, for each GPU attention path and
under chunking, preemption and prefix caching; every block is free again afterwards (the make_llm fixture)."""

from __future__ import annotations

import copy
from functools import cache

import pytest
import torch
from _engine_helpers import MAX_TOKENS, make_llm_fixture, ragged_prompts, reference_model  # noqa: F401

from paged_backend.engine import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@cache
def cuda_model(arch: str):
    return copy.deepcopy(reference_model(arch)).to("cuda")


@torch.no_grad()
def hf_greedy_on_cuda(arch: str, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = cuda_model(arch).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                    do_sample=False)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def assert_matches_hf_on_cuda(arch: str, prompts: list[list[int]], llm) -> None:
    outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy_on_cuda(arch, p) for p in prompts]


# auto (Triton for prefill and decode), Triton by name and the torch oracle; the csrc kernel runs decode batches
# alone, so test_ops_cuda.py tests it against the oracle
@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_on_cuda_matches_hf_generate_on_cuda(arch, backend, make_llm):
    llm = make_llm(arch, model=cuda_model(arch), attention_backend=backend)
    assert llm.engine.kv_cache.device.type == "cuda"
    assert_matches_hf_on_cuda(arch, ragged_prompts(), llm)


@pytest.mark.parametrize(
    "engine_kwargs",
    [dict(max_num_batched_tokens=16), dict(num_blocks=40, watermark=0.0), dict(max_num_seqs=4)],
    ids=["chunked-prefill", "recompute-preemption", "prefix-cache"],
)
def test_scheduling_on_cuda_matches_hf_generate_on_cuda(engine_kwargs, make_llm):
    system = list(range(30, 54))
    prompts = ragged_prompts(16, seed=1, longest=12, prefix=system)
    llm = make_llm("llama", model=cuda_model("llama"), **engine_kwargs)
    assert_matches_hf_on_cuda("llama", prompts, llm)
    stats = llm.engine.stats()
    assert stats.num_split_prefills + stats.num_preemptions + stats.prefix_cache_hits > 0


def test_decode_graphs_on_cuda_match_hf_generate_and_replay(make_llm):
    llm = make_llm("llama", model=cuda_model("llama"), max_cudagraph_capture_size=16, max_num_seqs=12)
    graphs = llm.engine.runner.decode_graphs
    assert graphs.capture and sorted(graphs.graphs) == graphs.sizes == [1, 2, 4, 8, 12]  # all captured at startup
    captured = dict(graphs.graphs)
    assert_matches_hf_on_cuda("llama", ragged_prompts(), llm)
    assert graphs.capture and graphs.replays == graphs.steps > 0  # every decode step replayed, none fell back
    assert graphs.graphs == captured  # and none waited for a capture


def test_decode_graphs_are_captured_again_after_sleep(make_llm):
    from paged_backend.engine.sleep import EngineSleep

    llm = make_llm("llama", model=cuda_model("llama"), max_cudagraph_capture_size=8, max_num_seqs=8)
    prompts = ragged_prompts(8, seed=3)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    graphs = llm.engine.runner.decode_graphs
    sleep = EngineSleep(llm.engine)
    sleep.sleep(1)
    assert not graphs.graphs  # their memory freed with the pool
    sleep.wake_up()
    assert sorted(graphs.graphs) == graphs.sizes  # captured again over the new pool on waking
    replays = graphs.replays
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == first
    assert graphs.replays > replays


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariance_on_cuda(dtype):
    """test_batch_invariant.py's crowd, on the GPU: alone, in a chunked, preempting batch of 33 others with a prefix
    hit, and re-scored with prompt logprobs, a request's tokens and logprobs are bitwise the same."""
    check_batch_invariance("cuda", dtype)


def check_batch_invariance(device: str, dtype: str) -> None:
    from paged_backend.engine import LLM
    from paged_backend.worker.default_model import TINY_MODEL
    from tests.test_batch_invariant import CROWDED, TARGET, TARGETS, result, run_crowd, watch_target

    def invariant_llm(**options):
        options.setdefault("num_blocks", 512)  # not 90% of the GPU: other test workers share it
        return LLM(TINY_MODEL, device=device, dtype=dtype, batch_invariant=True, **options)

    alone_llm = invariant_llm()
    alone = [result(alone_llm.generate([prompt], params)[0]) for prompt, params in TARGETS]
    llm = invariant_llm(**CROWDED)
    seen = watch_target(llm)
    assert [result(output) for output in run_crowd(llm)] == alone
    assert seen[0][1] > 0 and any(length > len(TARGET) for length, _ in seen), seen  # a prefix hit, a preemption
    rescoring = invariant_llm(max_num_batched_tokens=16)
    for (prompt, _), (tokens, logprobs) in zip(TARGETS, alone, strict=True):
        [output] = rescoring.generate([prompt + tokens], SamplingParams(max_tokens=1, prompt_logprobs=3))
        assert output.prompt_logprobs[len(prompt) :] == logprobs
