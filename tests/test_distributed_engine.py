"""Tensor and pipeline parallelism through `LLM`: greedy tokens with TP=2, PP=2 and TP=2 x PP=2 equal one
process and HF generate for a GQA Llama (KV heads split), a Llama with one KV head (replicated) and Qwen2.

Ranks are forked worker processes of one thread each (gloo); each case checks blocks and child processes after.
The near-tie argument is in tests/_distributed_helpers.py.
"""

import os
import signal

import psutil
import pytest
import torch

from paged_backend.distributed.driver import WorkerFailed
from paged_backend.engine import LLM, SamplingParams
from paged_backend.errors import InvalidRequest, UnsupportedModel
from tests._distributed_helpers import (
    MODELS,
    PROMPTS,
    assert_no_children,
    close_and_check,
    generate,
    reference,
    save_models,
)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    torch.set_num_threads(1)
    return save_models(tmp_path_factory.mktemp("tp-models"))


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
def test_parallel_greedy_equals_one_process_and_hf(model_dirs, name, layout):
    expected = reference(name)
    single = LLM(model_dirs[name], device="cpu", num_blocks=64, block_size=4)
    assert generate(single) == expected
    llm = LLM(model_dirs[name], device="cpu", num_blocks=64, block_size=4, **layout)
    assert generate(llm) == expected
    close_and_check(llm)


def test_tp_times_pp_with_forks_copies_and_swaps(model_dirs):
    """TP=2 x PP=2 (4 ranks) under pressure: n=2 siblings share blocks (copy-on-write copies), a small pool forces
    preemption by swapping; every rank replays the driver's block copies and swaps, so tokens still match."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
    options = dict(device="cpu", num_blocks=20, block_size=4, swap_space=0.001, preemption_mode="swap")
    expected = [
        [c.token_ids for c in out.outputs] for out in LLM(model_dirs["llama-gqa"], **options).generate(PROMPTS, params)
    ]
    llm = LLM(model_dirs["llama-gqa"], tensor_parallel_size=2, pipeline_parallel_size=2, **options)
    assert [[c.token_ids for c in out.outputs] for out in llm.generate(PROMPTS, params)] == expected
    assert llm.engine.stats().num_preemptions > 0
    close_and_check(llm)


def test_killed_worker_fails_the_batch_and_leaves_nothing(model_dirs):
    llm = LLM(model_dirs["llama-gqa"], device="cpu", num_blocks=64, block_size=4, tensor_parallel_size=2)
    engine = llm.engine
    engine.add_request(
        "victim", prompt_token_ids=PROMPTS[0], sampling_params=SamplingParams(max_tokens=200, ignore_eos=True)
    )
    for _ in range(3):
        engine.step()
    [worker] = psutil.Process(os.getpid()).children()
    worker.send_signal(signal.SIGKILL)
    with pytest.raises(WorkerFailed, match=rf"worker rank 1 \(pid {worker.pid}\) was killed by signal 9"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=50))  # joins the running request, then the step fails
    engine.abort_request("victim")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - 1
    assert_no_children()
    with pytest.raises(WorkerFailed):  # the engine stays down and says why
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))


def test_hung_worker_fails_after_the_timeout(model_dirs):
    llm = LLM(
        model_dirs["llama-gqa"], device="cpu", num_blocks=64, tensor_parallel_size=2, distributed_timeout_seconds=2
    )
    [worker] = psutil.Process(os.getpid()).children()
    worker.suspend()  # SIGSTOP: alive but silent
    with pytest.raises(WorkerFailed, match="stopped answering within distributed_timeout_seconds"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks - 1
    assert_no_children()


def test_unsupported_layouts_are_refused_before_starting(model_dirs):
    with pytest.raises(UnsupportedModel, match="4 attention heads do not split over tensor_parallel_size=3"):
        LLM(model_dirs["qwen2"], device="cpu", num_blocks=16, tensor_parallel_size=3)
    with pytest.raises(UnsupportedModel, match="pipeline_parallel_size=4 exceeds the model's 2 decoder layers"):
        LLM(model_dirs["qwen2"], device="cpu", num_blocks=16, pipeline_parallel_size=4)
    with pytest.raises(InvalidRequest, match="unknown engine option"):
        LLM(model_dirs["qwen2"], device="cpu", tensor_parallel_sise=2)
    assert_no_children()
