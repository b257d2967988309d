"""The Ray executor: worker ranks are Ray actors in a placement group on a local Ray instance (one session for
every case: Ray's start-up is the slow part). Greedy tokens with TP=2 equal HF for all three
models (each actor imports torch anew, ~5 s a case on the CI box).
The near-tie argument is in tests/_distributed_helpers.py."""

import time

import psutil
import pytest
import torch

from paged_backend.engine import LLM
from tests._distributed_helpers import DTYPE, assert_groups_closed, generate, reference, save_models

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")


@pytest.fixture(scope="module")
def ray_session():
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("ray-models"))


def ray_worker_processes() -> list[psutil.Process]:
    """Processes running our worker actors (Ray titles them after the actor class)."""
    return [p for p in psutil.process_iter(["cmdline"]) if "RayWorker" in " ".join(p.info["cmdline"] or [])]


def settled_worker_processes(expected: int, timeout: float = 15) -> list[psutil.Process]:
    """The worker processes once at most `expected` remain (the previous case's actor may still be exiting), or
    whatever is left at the timeout."""
    deadline = time.monotonic() + timeout
    while len(workers := ray_worker_processes()) > expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return workers


@pytest.mark.parametrize("name", ["llama-gqa", "llama-kv1", "qwen2"])
def test_ray_tp2_greedy_equals_hf(ray_session, model_dirs, name):
    llm = LLM(model_dirs[name], device="cpu", dtype=DTYPE, num_blocks=64, block_size=4, tensor_parallel_size=2,
              distributed_executor_backend="ray")  # fmt: skip
    try:  # closed whatever happens: a parallel engine left open holds this process's torch.distributed group
        assert len(settled_worker_processes(1)) == 1
        assert generate(llm) == reference(name)
        manager = llm.engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks - 1
    finally:
        llm.engine.close()
    _, alive = psutil.wait_procs(ray_worker_processes(), timeout=10)
    assert not alive, f"worker actors left behind: {alive}"
    assert_groups_closed()
