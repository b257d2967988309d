"""TGI's sharded layout: `launch --num-shard 2 --backend grpc` starts two tensor-parallel shards and drives them as
one; greedy tokens through the text-generation client equal one process and HF generate; a shard that dies takes
the launcher down (exit 1) and no child is left behind. `--backend paged --num-shard 2` runs the engine's own tensor
parallelism (a second rank process) behind the same HTTP face.

The model is the embedded tiny Llama (8 query heads, 2 KV heads: one KV head per rank). A 2-way fp32 all-reduce can
differ from one process by rounding (~1e-6); the smallest gap between the top two logits over these prompts' greedy
steps is 0.007, so no near-tie can flip.
"""

from __future__ import annotations

import shutil
import tempfile

import psutil
import pytest
import torch
from text_generation import Client

from paged_backend.engine import LLM, SamplingParams
from paged_backend.worker.default_model import TINY_MODEL
from paged_backend.worker.models import embedded_model
from tests._distributed_helpers import engine_processes
from tests._tgi_helpers import MAX_NEW_TOKENS, PROMPTS, ROUTER_ARGS, TgiServer, free_port, running, serving_in_thread


def hf_greedy_tokens() -> list[list[int]]:
    model, tokenizer = embedded_model()
    tokens = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        tokens.append(out[0, ids.shape[1] :].tolist())
    return tokens


def client_tokens(url: str) -> list[list[int]]:
    client = Client(url, timeout=120)
    return [
        [token.id for token in client.generate(prompt, max_new_tokens=MAX_NEW_TOKENS).details.tokens]
        for prompt in PROMPTS
    ]


def test_launch_num_shard_2_matches_one_process_and_hf_generate_and_goes_down_with_a_shard():
    directory = tempfile.mkdtemp(prefix="tgi-", dir="/tmp")  # unix socket paths must stay short
    grpc_args = ["--num-shard", "2", "--shard-uds-path", f"{directory}/shard", "--master-port", str(free_port()),
                 "--num-blocks", "128", *ROUTER_ARGS]  # fmt: skip
    server = TgiServer("grpc", grpc_args)
    try:
        with running(server):
            children = psutil.Process(server.process.pid).children(recursive=True)
            assert len(children) == 2  # one shard per rank
            grpc_tokens = client_tokens(server.url)
            server.wait_until_drained()  # every KV slot back in the router's pool
            # A shard that dies takes the launcher down, non-zero, with the other shard (TGI's launcher does too).
            children[1].kill()
            assert server.process.wait(timeout=60) == 1
            assert "exited with code -9" in server.output()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    _, still_running = psutil.wait_procs(children, timeout=15)
    assert not still_running, f"children left behind: {still_running}"
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS)
    llm = LLM(TINY_MODEL, device="cpu", num_blocks=64)
    one_process = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]
    expected = hf_greedy_tokens()
    assert one_process == expected
    assert grpc_tokens == expected


@pytest.mark.parametrize("speculate", [[], ["--speculate", "2"]], ids=["plain", "speculate"])
def test_launch_paged_num_shard_2_runs_the_engine_tensor_parallel(speculate):
    from paged_backend.tgi.http.app import create_app
    from paged_backend.tgi.launcher.flags import parse_flags
    from paged_backend.tgi.launcher.launch import build_backend, router_settings

    flags = ["--model-id", TINY_MODEL, "--num-shard", "2", "--device", "cpu", "--num-blocks", "64",
             "--max-total-tokens", "512"]  # fmt: skip
    args = parse_flags([*flags, *speculate])
    backend = build_backend(args)
    engine = backend.async_engine.engine
    try:
        assert engine.config.parallel.tensor_parallel_size == 2
        workers = engine_processes()
        assert workers  # the second rank runs in its own process
        with serving_in_thread(create_app(backend, router_settings(args, backend.max_model_len))) as url:
            tokens = client_tokens(url)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - 1
        assert (engine.stats().spec_decode_num_drafts > 0) == bool(speculate)
    finally:
        engine.close()
    _, still_running = psutil.wait_procs(workers, timeout=15)
    assert not still_running, f"ranks left behind: {still_running}"
    assert tokens == hf_greedy_tokens()


def test_sharded_shard_refuses_a_launcher_environment_that_does_not_add_up(monkeypatch):

    from paged_backend.errors import InvalidRequest
    from paged_backend.tgi.launcher.flags import parse_flags
    from paged_backend.tgi.launcher.launch import engine_config, num_shards
    from paged_backend.tgi.shard.tensor_parallel import shard_rank

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InvalidRequest, match="needs --sharded"):
        shard_rank(False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(InvalidRequest, match="MASTER_ADDR"):
        shard_rank(True)
    with pytest.raises(SystemExit, match="reference backend"):
        num_shards(parse_flags(["--backend", "reference", "--num-shard", "2"]))
    with pytest.raises(SystemExit, match="disabled"):
        num_shards(parse_flags(["--sharded", "false", "--num-shard", "2"]))
    assert num_shards(parse_flags(["--backend", "grpc"])) is None
    assert engine_config(parse_flags(["--num-shard", "2"])).parallel.tensor_parallel_size == 2  # paged: engine TP
    assert torch.cuda.device_count() >= 2 or "--num-shard N" in _error(num_shards, parse_flags(["--sharded", "true"]))


def _error(function, *args) -> str:
    try:
        function(*args)
    except SystemExit as error:
        return str(error)
    return ""
