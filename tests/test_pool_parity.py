"""One KV budget for every face: `run`, `serve`, `launch` and the TGI shard size the same pool for the same model,
memory and flags (the default budget of `core.kv_budget`), and each reports it where its users look: run's
summary, the `paged_backend:cache_config_info` metric of serve and launch (vLLM's `cache_config_info`), and the
shard's Warmup answer (`max_supported_total_tokens`, which TGI's router reads)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc

from paged_backend.core.kv_budget import KVShape, kv_memory_bytes, num_blocks_for_budget
from paged_backend.tgi.proto import generate_pb2_grpc as pb_grpc
from paged_backend.worker.default_model import TINY_MODEL
from paged_backend.worker.models import load_model
from tests._server_helpers import running_server
from tests._tgi_helpers import Shard, TgiServer, running, warmup_request

BLOCK_SIZE = 16


def blocks_in_metrics(metrics: dict[str, float]) -> int:
    (name,) = [name for name in metrics if name.startswith("paged_backend:cache_config_info")]
    assert f'block_size="{BLOCK_SIZE}"' in name, name
    return int(re.search(r'num_gpu_blocks="(\d+)"', name).group(1))


def test_run_serve_launch_and_the_shard_size_the_same_pool():
    model, _ = load_model(TINY_MODEL, device="cpu")  # the model every face below is started with
    shape = KVShape.of(model.config)
    expected = num_blocks_for_budget(shape.num_layers, shape.num_kv_heads, shape.head_dim, BLOCK_SIZE, model.dtype,
                                     memory_bytes=kv_memory_bytes(model.device))  # fmt: skip
    directory = tempfile.mkdtemp(prefix="tgi-", dir="/tmp")  # unix socket paths must stay short
    launch = TgiServer("paged", server_args=["--device", "cpu"])  # the default budget: no pool flags
    shard = Shard(f"{directory}/shard", ["--device", "cpu"])
    reported = {}
    try:
        with running_server() as server, running(launch, shard):
            run = subprocess.run(
                [str(Path(sys.executable).parent / "paged-backend"), "run", "--model", TINY_MODEL, "--device", "cpu", "--max-tokens", "2",
                 "--no-progress"],
                input="Hello\n", capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert run.returncode == 0, run.stderr
            reported["run"] = int(re.search(r"KV pool\s+(\d+) blocks of 16 tokens", run.stderr).group(1))
            reported["serve"] = blocks_in_metrics(server.metrics())
            reported["launch"] = blocks_in_metrics(launch.metrics())
            with grpc.insecure_channel(f"unix://{shard.socket_path}") as channel:
                warm = pb_grpc.TextGenerationServiceStub(channel).Warmup(warmup_request(max_input=255, max_total=256))
            reported["shard"] = warm.max_supported_total_tokens // BLOCK_SIZE
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert reported == dict.fromkeys(reported, expected), f"expected {expected} blocks everywhere: {reported}"
