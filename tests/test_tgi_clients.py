"""The real TGI clients, unchanged, against `python -m paged_backend.tgi` in paged and reference modes."""

from __future__ import annotations

import asyncio

import pytest
from huggingface_hub import InferenceClient
from text_generation import AsyncClient, Client
from text_generation.errors import OverloadedError, ValidationError

from tests._tgi_helpers import MAX_NEW_TOKENS, TgiServer, greedy_texts, running

BACKENDS = ("paged", "reference")


@pytest.fixture(scope="module")
def servers():
    processes = [TgiServer(backend) for backend in BACKENDS]
    with running(*processes):
        yield {server.backend: server for server in processes}


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
def test_errors_map_to_client_exceptions(servers, backend):
    client = Client(servers[backend].url, timeout=120)
    with pytest.raises(ValidationError, match="`inputs` tokens \\+ `max_new_tokens` must be <= 512"):
        client.generate("Hello", max_new_tokens=600)
    with pytest.raises(ValidationError, match="`top_n_tokens` must be >= 0 and <= 5"):
        client.generate("Hello", max_new_tokens=2, top_n_tokens=9)
    with pytest.raises(ValidationError, match="`top_n_tokens` must be >= 0 and <= 5"):
        list(client.generate_stream("Hello", max_new_tokens=2, top_n_tokens=9))


def test_greedy_text_is_identical_across_backends(servers):
    paged, reference = (greedy_texts(servers[backend].url) for backend in BACKENDS)
    assert paged == reference


def test_no_kv_block_is_held_after_requests(servers):
    metrics = servers["paged"].wait_until_drained()
    assert metrics["tgi_request_success"] > 0
    assert metrics["tgi_batch_max_total_tokens"] > 0


def test_overload_is_429_with_overloaded_error():
    with running(TgiServer("paged", ["--max-concurrent-requests", "1"])) as (server,):
        client = Client(server.url, timeout=120)
        stream = client.generate_stream("Hello", max_new_tokens=200)
        next(stream)  # holds the only permit while streaming
        with pytest.raises(OverloadedError, match="Model is overloaded"):
            client.generate("Hello", max_new_tokens=2)
        stream.close()
        server.wait_until_drained()
