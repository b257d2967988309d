"""The real TGI clients, unchanged, against `python -m paged_backend.tgi` in paged, reference and grpc modes.

`--backend grpc` is our Python v3 router driving our own shard subprocess over a unix socket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

import httpx
import pytest
from huggingface_hub import InferenceClient
from text_generation import AsyncClient, Client
from text_generation.errors import ValidationError
from text_generation.types import Message

from tests._tgi_helpers import BACKENDS, MAX_NEW_TOKENS, every_backend, greedy_texts

SHARD_BLOCKS = 257


@pytest.fixture(scope="module")
def servers():
    with every_backend(SHARD_BLOCKS) as servers:
        yield servers


@pytest.mark.parametrize("backend", BACKENDS)
def test_text_generation_client_generate_details(servers, backend):
    response = Client(servers[backend].url, timeout=120).generate("Hello world", max_new_tokens=MAX_NEW_TOKENS)
    details = response.details
    assert details.generated_tokens == len(details.tokens) <= MAX_NEW_TOKENS
    assert details.finish_reason.value in {"length", "eos_token"}
    assert details.seed is None  # greedy
    assert details.prefill == []
    assert all(token.logprob <= 0 for token in details.tokens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_text_generation_stream_matches_generate(servers, backend):
    client = Client(servers[backend].url, timeout=120)
    expected = client.generate("Hello world", max_new_tokens=MAX_NEW_TOKENS)
    responses = list(client.generate_stream("Hello world", max_new_tokens=MAX_NEW_TOKENS))
    assert [r.token.id for r in responses] == [t.id for t in expected.details.tokens]
    assert [r.generated_text for r in responses[:-1]] == [None] * (len(responses) - 1)
    assert responses[-1].generated_text == expected.generated_text
    assert responses[-1].details.generated_tokens == expected.details.generated_tokens


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_client_generate_and_stream(servers, backend):
    async def run():
        client = AsyncClient(servers[backend].url, timeout=120)
        response = await client.generate("Hello world", max_new_tokens=MAX_NEW_TOKENS)
        streamed = [r async for r in client.generate_stream("Hello world", max_new_tokens=MAX_NEW_TOKENS)]
        return response, streamed

    response, streamed = asyncio.run(run())
    assert streamed[-1].generated_text == response.generated_text


@pytest.mark.parametrize("backend", BACKENDS)
def test_hub_client_details_and_stream(servers, backend):
    hub = InferenceClient(model=servers[backend].url, timeout=120)
    details = hub.text_generation("Hello world", max_new_tokens=6, details=True, return_full_text=False)
    assert details.details.generated_tokens == len(details.details.tokens)
    pieces = list(hub.text_generation("Hello world", max_new_tokens=6, stream=True, details=True))
    assert pieces[-1].generated_text == "Hello world" + details.generated_text  # the `/` route prepends the prompt
    chunks = list(hub.chat_completion([{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True))
    plain = hub.chat_completion([{"role": "user", "content": "hi"}], max_tokens=6, temperature=0)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert streamed.replace("\ufffd", "") == plain.choices[0].message.content.replace("\ufffd", "")


@pytest.mark.parametrize("backend", BACKENDS)
def test_text_generation_client_chat(servers, backend):
    client = Client(servers[backend].url, timeout=120)
    hub = InferenceClient(model=servers[backend].url, timeout=120)
    messages = [Message(role="user", content="hi")]
    response = client.chat(messages, max_tokens=6, temperature=0)
    expected = hub.chat_completion([{"role": "user", "content": "hi"}], max_tokens=6, temperature=0)
    assert response.choices[0].message.content == expected.choices[0].message.content
    assert response.usage["completion_tokens"] == 6


@pytest.mark.parametrize("backend", BACKENDS)
def test_errors_map_to_client_exceptions(servers, backend):
    client = Client(servers[backend].url, timeout=120)
    with pytest.raises(ValidationError, match="`inputs` tokens \\+ `max_new_tokens` must be <= 512"):
        client.generate("Hello", max_new_tokens=600)
    with pytest.raises(ValidationError, match="`top_n_tokens` must be >= 0 and <= 5"):
        client.generate("Hello", max_new_tokens=2, top_n_tokens=9)
    with pytest.raises(ValidationError, match="`top_n_tokens` must be >= 0 and <= 5"):
        list(client.generate_stream("Hello", max_new_tokens=2, top_n_tokens=9))


def test_greedy_text_is_identical_across_backends(servers):
    paged, reference, grpc = (greedy_texts(servers[backend].url) for backend in BACKENDS)
    assert paged == reference
    assert grpc == paged


@pytest.mark.parametrize("backend", ["paged", "grpc"])
def test_concurrent_requests_and_disconnects_free_every_block(servers, backend):
    client = Client(servers[backend].url, timeout=120)
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
    metrics = servers[backend].wait_until_drained()
    assert metrics["tgi_request_success"] > 0 and metrics["tgi_batch_max_total_tokens"] > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_details_and_top_tokens(servers, backend):
    response = Client(servers[backend].url, timeout=120).generate(
        "Hello world", max_new_tokens=4, decoder_input_details=True, top_n_tokens=3
    )
    prefill = response.details.prefill
    assert prefill[0].logprob is None and all(token.logprob <= 0 for token in prefill[1:])
    assert len(response.details.top_tokens) == 4 and all(len(tops) == 3 for tops in response.details.top_tokens)


def test_grpc_router_sizes_its_pool_from_the_shard_warmup(servers):
    metrics = servers["grpc"].metrics()
    assert metrics["tgi_batch_max_total_tokens"] == (SHARD_BLOCKS - 1) * 16
    assert metrics['tgi_batch_inference_success{method="prefill"}'] > 0
    assert metrics['tgi_batch_inference_success{method="decode"}'] > 0


def test_grpc_health_runs_the_liveness_prefill_on_block_0(servers):
    # The router starts unhealthy, so its first /health (at start-up) already ran the liveness prefill.
    assert httpx.get(f"{servers['grpc'].url}/health", timeout=30).status_code == 200
