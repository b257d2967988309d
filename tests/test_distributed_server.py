"""`paged-backend serve --tensor-parallel-size 2` through the openai client: greedy tokens equal HF; then a worker
killed mid-generation fails the request with a 5xx, the server exits 1 and leaves no worker process behind.
The near-tie argument is in tests/_distributed_helpers.py."""

import os
import threading
import time
from unittest import mock

import openai
import psutil
import pytest

from tests._distributed_helpers import DTYPE, MAX_TOKENS, PROMPTS, engine_processes, reference, save_models
from tests._server_helpers import running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = save_models(tmp_path_factory.mktemp("serve-tp-models"))["llama-gqa"]
    flags = ("--model", model_dir, "--dtype", DTYPE, "--num-blocks", "512", "--block-size", "4", "-tp", "2")
    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}), running_server(*flags) as running:
        yield running


def test_serve_tp2_greedy_equals_hf(server):
    assert_greedy_equals_hf(server, "llama-gqa")


@pytest.mark.parametrize(("name", "layout"), [("llama-kv1", ("-pp", "2")), ("qwen2", ("-tp", "2"))])
def test_serve_other_models_and_pipeline_parallel_equal_hf(tmp_path_factory, name, layout):
    """The other two models, one through pipeline stages; leaving `running_server` sends SIGTERM, which must stop
    the worker rank too."""
    model_dir = save_models(tmp_path_factory.mktemp(f"serve-{name}"))[name]
    flags = ("--model", model_dir, "--dtype", DTYPE, "--num-blocks", "512", "--block-size", "4", *layout)
    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}), running_server(*flags) as running:
        assert_greedy_equals_hf(running, name)
        [worker] = engine_processes(running.process.pid)
    _, alive = psutil.wait_procs([worker], timeout=15)
    assert not [process for process in alive if process.status() != psutil.STATUS_ZOMBIE], "SIGTERM left a rank"


def assert_greedy_equals_hf(server, name: str) -> None:
    client = server.client()
    for prompt, expected in zip(PROMPTS, reference(name), strict=True):
        completion = client.completions.create(
            model=client.models.list().data[0].id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )  # fmt: skip
        tokens = [int(token.removeprefix("token_id:")) for token in completion.choices[0].logprobs.tokens]
        assert tokens == expected
    server.wait_until_drained()


def test_killed_worker_is_a_5xx_and_the_server_exits_nonzero(server):
    [worker] = engine_processes(server.process.pid)
    client = server.client()
    model = client.models.list().data[0].id
    failures = []

    def long_request():
        try:
            client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=1000, extra_body={"ignore_eos": True})
        except openai.APIStatusError as error:
            failures.append(error)

    request = threading.Thread(target=long_request)
    request.start()
    deadline = time.monotonic() + 30
    while server.metrics()["paged_backend:num_requests_running"] < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    worker.kill()
    request.join(60)
    assert [error.status_code for error in failures] == [500]
    assert "worker rank 1" in failures[0].message and "killed by signal 9" in failures[0].message
    assert server.process.wait(timeout=60) == 1
    assert not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE
