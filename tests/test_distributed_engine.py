"""Tensor and pipeline parallelism through `LLM`: greedy tokens with TP=2, PP=2 and TP=2 x PP=2 equal one
process and HF generate for a GQA Llama (KV heads split), a Llama with one KV head (replicated) and Qwen2.

Ranks are forked worker processes of one thread each (gloo); each case checks blocks and child processes after.
The near-tie argument is in tests/_distributed_helpers.py.
"""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from paged_backend.bench.speculative import truncated
from paged_backend.distributed.driver import WorkerFailed
from paged_backend.distributed.executor import free_port
from paged_backend.engine import LLM, SamplingParams
from paged_backend.errors import InvalidRequest, UnsupportedModel
from paged_backend.worker.models import tiny_model
from tests._distributed_helpers import (
    DTYPE,
    MODELS,
    OTHER_LAUNCHES,
    PROMPTS,
    assert_groups_closed,
    assert_no_children,
    close_and_check,
    engine_processes,
    generate,
    reference,
    save_models,
)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    torch.set_num_threads(1)
    return save_models(tmp_path_factory.mktemp("tp-models"))


@pytest.fixture(scope="module")
def torchrun_nodes(model_dirs, tmp_path_factory):
    """Two torchrun "nodes" on localhost (one rank each, c10d rendezvous on 127.0.0.1), started when the module
    begins so their start-up overlaps the other cases; the last case collects them."""
    out = tmp_path_factory.mktemp("torchrun") / "tokens.json"
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "tests/_torchrun_generate.py", str(out),
               *model_dirs.values()]  # fmt: skip
    nodes = [
        subprocess.Popen(
            [*command[:7], "--node-rank", str(rank), *command[7:]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=Path(__file__).parents[1],
        )  # fmt: skip
        for rank in range(2)
    ]
    OTHER_LAUNCHES.update(node.pid for node in nodes)
    yield nodes, out
    for node in nodes:
        node.kill()
        node.wait()


@pytest.fixture(scope="module", autouse=True)
def start_torchrun_early(torchrun_nodes):
    return torchrun_nodes


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
def test_parallel_greedy_equals_one_process_and_hf(model_dirs, name, layout):
    expected = reference(name)
    single = LLM(model_dirs[name], device="cpu", dtype=DTYPE, num_blocks=64, block_size=4)
    assert generate(single) == expected
    llm = LLM(model_dirs[name], device="cpu", dtype=DTYPE, num_blocks=64, block_size=4, **layout)
    assert generate(llm) == expected
    close_and_check(llm)


@pytest.mark.parametrize(
    "method, layout",
    [("ngram", dict(tensor_parallel_size=2)), ("draft_model", dict(pipeline_parallel_size=2))],
    ids=["ngram-tp2", "draft-pp2"],
)
def test_speculation_gives_plain_tokens_on_every_layout(model_dirs, method, layout):
    """Drafts ride in the driver's packed step as more query rows of their sequence, so every rank runs them; the
    driver verifies and rolls back (its block manager is the only one). A draft model runs in the driver's process."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if method == "draft_model":
        arch, kv_heads, seed = MODELS["llama-gqa"]
        spec = {"model": truncated(tiny_model(arch, seed=seed, num_kv_heads=kv_heads), 1), "num_speculative_tokens": 3}
    options = dict(device="cpu", dtype=DTYPE, num_blocks=64, block_size=4)
    llm = LLM(model_dirs["llama-gqa"], speculative_config=spec, **options, **layout)
    assert generate(llm) == reference("llama-gqa")
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0
    if method == "draft_model":
        draft_pool = llm.engine.speculator.draft.block_manager
        assert draft_pool.num_free_blocks == draft_pool.num_blocks - 1
    close_and_check(llm)


def test_tp_times_pp_with_forks_copies_and_swaps(model_dirs):
    """TP=2 x PP=2 (4 ranks) under pressure: n=2 siblings share blocks (copy-on-write copies), a small pool forces
    preemption by swapping; every rank replays the driver's block copies and swaps, so tokens still match."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
    options = dict(device="cpu", dtype=DTYPE, num_blocks=20, block_size=4, swap_space=0.001, preemption_mode="swap")
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
    [worker] = engine_processes()
    worker.send_signal(signal.SIGKILL)
    with pytest.raises(WorkerFailed, match=rf"worker rank 1 \(pid {worker.pid}\) was killed by signal 9"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=50))  # joins the running request, then the step fails
    engine.abort_request("victim")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - 1
    assert_no_children()
    with pytest.raises(WorkerFailed):  # the engine stays down and says why
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))


def test_worker_that_dies_while_starting_fails_the_start(model_dirs):
    killed = threading.Event()

    def kill_the_worker_as_it_starts():
        while not killed.wait(0.005):
            # Ranks fork from multiprocessing's fork server; the test's own children (that server while it is still
            # starting, before psutil can tell it by its command line) are not ranks.
            for process in engine_processes():
                if process.ppid() != os.getpid():
                    process.kill()
                    killed.set()

    killer = threading.Thread(target=kill_the_worker_as_it_starts)
    killer.start()
    try:
        with pytest.raises(WorkerFailed, match=r"the workers failed to start: worker rank 1 .* killed by signal 9"):
            LLM(model_dirs["qwen2"], device="cpu", num_blocks=16, tensor_parallel_size=2, distributed_timeout_seconds=3)
    finally:
        killed.set()
        killer.join()
    assert_no_children()
    assert_groups_closed()


def test_hung_worker_fails_after_the_timeout(model_dirs):
    llm = LLM(
        model_dirs["llama-gqa"], device="cpu", num_blocks=64, tensor_parallel_size=2, distributed_timeout_seconds=2
    )
    [worker] = engine_processes()
    worker.suspend()  # SIGSTOP: alive but silent
    with pytest.raises(WorkerFailed, match="stopped answering within distributed_timeout_seconds"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks - 1
    assert_no_children()
    assert_groups_closed()


def test_unsupported_layouts_are_refused_before_starting(model_dirs):
    with pytest.raises(UnsupportedModel, match="4 attention heads do not split over tensor_parallel_size=3"):
        LLM(model_dirs["qwen2"], device="cpu", num_blocks=16, tensor_parallel_size=3)
    with pytest.raises(UnsupportedModel, match="pipeline_parallel_size=4 exceeds the model's 2 decoder layers"):
        LLM(model_dirs["qwen2"], device="cpu", num_blocks=16, pipeline_parallel_size=4)
    with pytest.raises(InvalidRequest, match="unknown engine option"):
        LLM(model_dirs["qwen2"], device="cpu", tensor_parallel_sise=2)
    assert_no_children()


def test_torchrun_two_nodes_equal_one_process_and_hf(torchrun_nodes, model_dirs):
    """`torchrun --nnodes 2` on localhost: each node runs the same script; the engine finds torchrun's
    environment, rank 0 drives and rank 1 serves inside `LLM()`. Greedy tokens equal HF for the three models."""
    nodes, out = torchrun_nodes
    for node in nodes:
        output, _ = node.communicate(timeout=240)
        assert node.returncode == 0, output
    tokens = json.loads(out.read_text())
    assert tokens == {model_dirs[name]: reference(name) for name in MODELS}
