"""`launch --backend grpc`: our Python v3 router serves the TGI API through our own shard subprocess."""

from __future__ import annotations

import concurrent.futures
import shutil
import tempfile

import httpx
import pytest
from text_generation import Client

from tests._tgi_helpers import MAX_NEW_TOKENS, Shard, TgiServer, greedy_texts, running

GRPC_ARGS = ["--max-batch-prefill-tokens", "512", "--waiting-served-ratio", "1.2", "--max-waiting-tokens", "3"]


@pytest.fixture(scope="module")
def servers():
    directory = tempfile.mkdtemp(prefix="tgi-", dir="/tmp")  # unix socket paths must stay short
    uds_path = f"{directory}/shard"
    shard = Shard(uds_path, ["--num-blocks", "257", "--device", "cpu"])
    paged = TgiServer("paged")
    with running(shard, paged):
        grpc_server = TgiServer("grpc", ["--shard-uds-path", uds_path, *GRPC_ARGS])
        with running(grpc_server):
            yield {"paged": paged, "grpc": grpc_server}
    shutil.rmtree(directory, ignore_errors=True)


def test_grpc_greedy_text_equals_the_in_process_engine(servers):
    assert greedy_texts(servers["grpc"].url) == greedy_texts(servers["paged"].url)


def test_grpc_concurrent_streams_batch_together_and_free_every_block(servers):
    client = Client(servers["grpc"].url, timeout=120)
    expected = client.generate("Hello world", max_new_tokens=MAX_NEW_TOKENS).generated_text

    def run(index: int) -> str:
        if index % 3 == 2:  # a client that goes away mid-stream
            stream = client.generate_stream("Hello world", max_new_tokens=50)
            next(stream)
            stream.close()
            return expected
        return client.generate("Hello world", max_new_tokens=MAX_NEW_TOKENS).generated_text

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert list(pool.map(run, range(6))) == [expected] * 6
    metrics = servers["grpc"].wait_until_drained()
    assert metrics["tgi_batch_max_total_tokens"] == 256 * 16


def test_grpc_prefill_details_and_top_tokens(servers):
    response = Client(servers["grpc"].url, timeout=120).generate(
        "Hello world", max_new_tokens=4, decoder_input_details=True, top_n_tokens=3
    )
    prefill = response.details.prefill
    assert prefill[0].logprob is None and all(token.logprob <= 0 for token in prefill[1:])
    assert len(response.details.top_tokens) == 4 and all(len(tops) == 3 for tops in response.details.top_tokens)


def test_grpc_health_runs_the_liveness_prefill(servers):
    assert httpx.get(f"{servers['grpc'].url}/health", timeout=30).status_code == 200
