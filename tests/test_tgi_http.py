"""The TGI HTTP face in-process on the paged engine: shapes, validation messages, status codes, no leaks."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from paged_backend.config import CacheConfig, EngineConfig, SchedulerConfig
from paged_backend.engine import Engine
from paged_backend.tgi.backends.paged import PagedBackend
from paged_backend.tgi.http.app import create_app
from paged_backend.tgi.http.settings import RouterSettings
from paged_backend.tgi.http.sse import with_keep_alive
from paged_backend.worker.default_model import TINY_MODEL
from tests._tgi_helpers import serving_in_thread

NUM_BLOCKS = 96


def make_engine(num_blocks: int = NUM_BLOCKS, max_model_len: int = 512) -> Engine:
    config = EngineConfig(
        model=TINY_MODEL,
        device="cpu",
        cache=CacheConfig(num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_model_len=max_model_len),
    )
    return Engine(config)


@pytest.fixture(scope="module")
def engine():
    return make_engine()


@pytest.fixture(scope="module")
def client(engine):
    settings = RouterSettings(max_input_tokens=255, max_total_tokens=256, api_key=None, payload_limit=10_000)
    with TestClient(create_app(PagedBackend(engine), settings, drain_timeout=5)) as test_client:
        yield test_client
    # Every request of the module finished, failed or was dropped: all blocks are free again.
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS - 1


def sse_events(text: str) -> list[dict | str]:
    frames = [frame for frame in text.split("\n\n") if frame]
    assert all(frame.startswith("data: ") for frame in frames), frames
    return [
        frame[len("data: ") :] if frame == "data: [DONE]" else json.loads(frame[len("data: ") :]) for frame in frames
    ]


def generate(client, **parameters):
    return client.post("/generate", json={"inputs": "Hello world", "parameters": parameters})


VALIDATION_CASES = [
    ({"temperature": 0}, "`temperature` must be strictly positive"),
    ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 3}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"best_of": 3}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"best_of": -1}, "`best_of` must be > 0 and <= 2. Given: -1"),  # was a 500 that also dropped the connection
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
    ({"truncate": 300}, "`truncate` must be strictly positive and less than 255. Given: 300"),
    (
        {"max_new_tokens": 250},
        "`inputs` tokens + `max_new_tokens` must be <= 256. Given: 11 `inputs` tokens and 250 `max_new_tokens`",
    ),
    ({"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
    (
        {"grammar": {"type": "regex", "value": ""}},
        "grammar is not valid: a regex grammar needs a non-empty string `value`",
    ),
    (
        {"grammar": {"type": "json", "value": "{not json"}},
        "grammar is not valid: `value` is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 "
        "(char 1)",
    ),
    ({"grammar": {"type": "json", "value": [1]}}, "grammar is not valid: a JSON schema must be an object, got list"),
    (
        {"grammar": {"type": "json", "value": {"type": "nonsense"}}},
        "grammar is not valid: 'nonsense' is not valid under any of the given schemas (at type)",
    ),
]


@pytest.mark.parametrize(("parameters", "message"), VALIDATION_CASES)
def test_validation_errors_are_422_with_tgi_messages(client, parameters, message):
    response = generate(client, **parameters)
    assert response.status_code == 422
    assert response.json() == {"error": f"Input validation error: {message}", "error_type": "validation"}


def test_a_seed_past_u64_names_the_exact_bound(client):
    response = generate(client, seed=2**64)
    assert response.status_code == 422 and "between 0 and 18446744073709551615 (a u64)" in response.json()["error"]


@pytest.mark.parametrize("route", ["/generate", "/generate_stream"])
@pytest.mark.parametrize("name", ["temperature", "top_p", "typical_p", "repetition_penalty"])
def test_nan_and_infinity_are_422_not_500(client, route, name):
    for value in ("NaN", "Infinity"):
        body = f'{{"inputs": "Hello", "parameters": {{"max_new_tokens": 2, "do_sample": true, "{name}": {value}}}}}'
        response = client.post(route, content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 422, (value, response.text)
        assert f"`{name}` must be" in response.json()["error"]


@pytest.mark.parametrize("route", ["/generate", "/generate_stream", "/v1/chat/completions"])
def test_a_json_body_sent_as_text_plain_is_415_as_axum_answers(client, route):
    body = {"inputs": "Hi", "messages": [{"role": "user", "content": "Hi"}]}
    response = client.post(route, content=json.dumps(body).encode(), headers={"Content-Type": "text/plain"})
    assert response.status_code == 415, response.text
    assert response.json()["error"] == "Expected request with `Content-Type: application/json`"


@pytest.mark.parametrize(
    "route, body",
    [("/generate", {"inputs": "a\ud800b"}), ("/generate_stream", {"inputs": "a\ud800b"}),
     ("/tokenize", {"inputs": "a\ud800b"}), ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}),
     ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 2})],
)  # fmt: skip
def test_a_lone_surrogate_is_422_not_500(client, route, body):
    response = client.post(route, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    assert "not valid Unicode" in response.json()["error"]


def test_empty_inputs_and_too_long_inputs(client):
    empty = client.post("/generate", json={"inputs": "", "parameters": {"max_new_tokens": 1}})
    assert empty.json()["error"] == "Input validation error: `inputs` cannot be empty"
    long = client.post("/generate", json={"inputs": "x" * 300, "parameters": {"max_new_tokens": 1}})
    assert long.status_code == 422 and "`inputs` tokens + `max_new_tokens` must be <= 256" in long.json()["error"]


def test_generate_details_and_headers(client):
    response = generate(client, max_new_tokens=5, details=True, top_n_tokens=2)
    body = response.json()
    assert set(body) == {"generated_text", "details"}
    details = body["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 5 and details["seed"] is None
    assert details["prefill"] == [] and len(details["tokens"]) == 5 and len(details["top_tokens"]) == 5
    assert set(details["tokens"][0]) == {"id", "text", "logprob", "special"}
    assert response.headers["x-generated-tokens"] == "5" and response.headers["x-prompt-tokens"] == "11"
    assert "details" not in generate(client, max_new_tokens=2).json()


def test_compat_route_returns_a_list_and_prepends_the_prompt_by_default(client):
    plain = generate(client, max_new_tokens=4).json()["generated_text"]
    compat = client.post("/", json={"inputs": "Hello world", "parameters": {"max_new_tokens": 4}}).json()
    assert compat == [{"generated_text": "Hello world" + plain}]
    explicit = {"max_new_tokens": 4, "return_full_text": False}
    assert client.post("/", json={"inputs": "Hello world", "parameters": explicit}).json()[0]["generated_text"] == plain


def test_stream_framing_and_last_event(client):
    body = {"inputs": "Hello world", "parameters": {"max_new_tokens": 3, "details": True}}
    response = client.post("/generate_stream", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-accel-buffering"] == "no"
    events = sse_events(response.text)
    assert [event["index"] for event in events] == [1, 2, 3]
    assert events[0]["generated_text"] is None and events[0]["details"] is None
    assert events[-1]["details"] == {"finish_reason": "length", "generated_tokens": 3, "seed": None, "input_length": 11}
    assert events[-1]["generated_text"] == generate(client, max_new_tokens=3).json()["generated_text"]


def test_stream_validation_errors_answer_before_the_stream_opens(client):
    # The document can only promise 4xx for bad input if the stream routes answer it before their 200.
    response = client.post(
        "/generate_stream", json={"inputs": "Hello", "parameters": {"best_of": 2, "do_sample": True}}
    )
    assert response.status_code == 422
    assert response.json() == {
        "error": "Input validation error: `best_of` != 1 is not supported when streaming tokens",
        "error_type": "validation",
    }
    compat = client.post("/", json={"inputs": "Hello", "parameters": {"temperature": 0}, "stream": True})
    assert compat.status_code == 422 and "`temperature` must be strictly positive" in compat.json()["error"]


def test_stop_sequence_is_kept_in_the_text(client):
    free = generate(client, max_new_tokens=8).json()["generated_text"]
    start = next(i for i in range(1, len(free) - 1) if "\ufffd" not in free[i : i + 2])
    stop = free[start : start + 2]
    response = generate(client, max_new_tokens=8, stop=[stop], details=True).json()
    assert response["details"]["finish_reason"] == "stop_sequence"
    assert response["generated_text"].endswith(stop) and free.startswith(response["generated_text"])


def test_seeded_sampling_is_reproducible_and_reports_the_seed(client):
    first = generate(client, max_new_tokens=6, do_sample=True, seed=7, details=True).json()
    second = generate(client, max_new_tokens=6, do_sample=True, seed=7, details=True).json()
    assert first == second and first["details"]["seed"] == 7


def test_best_of_returns_the_other_candidates(client):
    details = generate(client, max_new_tokens=4, best_of=2, do_sample=True, details=True).json()["details"]
    assert len(details["best_of_sequences"]) == 1
    assert set(details["best_of_sequences"][0]) >= {
        "generated_text",
        "finish_reason",
        "generated_tokens",
        "seed",
        "tokens",
    }


def test_decoder_input_details_returns_the_prompt_with_logprobs(client):
    details = generate(client, max_new_tokens=2, decoder_input_details=True).json()["details"]
    prefill = details["prefill"]
    assert len(prefill) == 11 and prefill[0]["logprob"] is None
    assert all(token["logprob"] <= 0 for token in prefill[1:]) and "".join(t["text"] for t in prefill) == "Hello world"
    stream = client.post("/generate_stream", json={"inputs": "Hi", "parameters": {"decoder_input_details": True}})
    assert stream.status_code == 422
    assert stream.json()["error"].endswith("`decoder_input_details` == true is not supported when streaming tokens")


def test_chat_stream_ends_with_done_and_matches_plain(client):
    body = {"model": "tgi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    plain = client.post("/v1/chat/completions", json=body).json()
    assert plain["object"] == "chat.completion" and plain["choices"][0]["finish_reason"] == "length"
    assert plain["usage"]["completion_tokens"] == 4
    options = {"include_usage": True}
    events = sse_events(
        client.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": options}).text
    )
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"] == plain["usage"]
    assert all(event["object"] == "chat.completion.chunk" for event in events[:-1])


def test_completions_single_batch_and_limits(client):
    body = {"model": "tgi", "prompt": ["Hello", "world"], "max_tokens": 3, "temperature": 0}
    response = client.post("/v1/completions", json=body).json()
    assert [choice["index"] for choice in response["choices"]] == [0, 1]
    too_many = client.post("/v1/completions", json={**body, "prompt": ["a"] * 5})
    assert too_many.status_code == 422 and "batch size exceeded" in too_many.json()["error"]
    suffix = client.post("/v1/completions", json={**body, "suffix": "x"})
    assert suffix.json() == {"error": "Input validation error: suffix not supported", "error_type": "validation"}
    events = sse_events(client.post("/v1/completions", json={**body, "stream": True}).text)
    assert events[-1] == "[DONE]" and {event["choices"][0]["index"] for event in events[:-1]} == {0, 1}


def test_info_routes(client):
    info = client.get("/info").json()
    assert info["max_input_tokens"] == 255 and info["max_total_tokens"] == 256 and info["max_best_of"] == 2
    assert info["router"] == "text-generation-router"
    assert client.get("/health").status_code == 200 and client.get("/ping").status_code == 200
    assert client.get("/v1/models").json()["data"][0]["object"] == "model"
    tokens = client.post("/tokenize", json={"inputs": "hello"}).json()
    assert [(t["text"], t["start"], t["stop"]) for t in tokens[:2]] == [("h", 0, 1), ("e", 1, 2)]
    assert "".join(token["text"] for token in tokens) == "hello"


def test_metrics_use_tgi_names(client):
    generate(client, max_new_tokens=1)
    text = client.get("/metrics").text
    for name in (
        "tgi_request_count ",
        "tgi_request_success ",
        "tgi_queue_size ",
        "tgi_request_duration_bucket",
        "tgi_request_generated_tokens_count",
        'tgi_request_failure{err="validation"}',
    ):
        assert name in text


def test_payload_limit_is_413(client):
    assert client.post("/generate", json={"inputs": "x" * 20_000}).status_code == 413


def test_api_key_is_required_when_set():
    engine = make_engine()  # an engine is stepped by one AsyncEngine only
    settings = RouterSettings(max_input_tokens=255, max_total_tokens=256, api_key="secret")
    with TestClient(create_app(PagedBackend(engine), settings, drain_timeout=5)) as guarded:
        denied = guarded.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 1}})
        assert denied.status_code == 401 and denied.content == b""
        headers = {"Authorization": "Bearer secret"}
        allowed = guarded.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 1}}, headers=headers)
        assert allowed.status_code == 200
        assert guarded.get("/health").status_code == 200


def test_overload_is_429_and_a_disconnect_frees_blocks_at_once(monkeypatch):
    # the held stream asks for thousands of tokens (seconds of work), so it still holds the permit at the check:
    # a short one could finish server-side, its bytes in the socket's buffers, before the second request came;
    # past the tiny model's 2048 positions, which vLLM's switch allows
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    long, num_blocks = 4096, 4096 // 16 + 8
    engine = make_engine(num_blocks, max_model_len=long)  # an engine is stepped by one AsyncEngine only
    settings = RouterSettings(max_input_tokens=255, max_total_tokens=long, max_concurrent_requests=1)
    with serving_in_thread(create_app(PagedBackend(engine), settings, drain_timeout=5)) as url:
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": long - 64}}
        with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=60) as stream:
            lines = stream.iter_lines()  # kept referenced: a collected iterator would close the connection
            next(lines)  # the stream holds the only permit
            response = httpx.post(f"{url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 1}})
            assert response.status_code == 429
            assert response.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
            assert engine.block_manager.num_free_blocks < num_blocks - 1
        deadline = time.monotonic() + 10  # the client is gone: the request is aborted, long before it ends
        while engine.block_manager.num_free_blocks != num_blocks - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.block_manager.num_free_blocks == num_blocks - 1
        assert engine.stats().generation_tokens < long - 64


def test_a_client_that_hangs_up_on_generate_is_aborted_at_once(monkeypatch):
    """Not streamed, nothing is written until the end: the server watches the connection itself."""
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # 4096 tokens, past the tiny model's positions
    long, num_blocks = 4096, 4096 // 16 + 8
    engine = make_engine(num_blocks, max_model_len=long)
    settings = RouterSettings(max_input_tokens=255, max_total_tokens=long, max_concurrent_requests=1)
    with serving_in_thread(create_app(PagedBackend(engine), settings, drain_timeout=5)) as url:
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": long - 64}}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/generate", json=body, timeout=1.0)
        deadline = time.monotonic() + 10
        while engine.block_manager.num_free_blocks != num_blocks - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.block_manager.num_free_blocks == num_blocks - 1
        assert engine.stats().generation_tokens < long - 64
        response = httpx.post(f"{url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 1}})
        assert response.status_code == 200  # its permit was given back too


def test_keep_alive_comments_fill_long_silences():
    async def slow_frames():
        await asyncio.sleep(0.2)
        yield "data: {}\n\n"

    async def collect() -> list[str]:
        return [frame async for frame in with_keep_alive(slow_frames(), interval=0.05)]

    frames = asyncio.run(collect())
    assert frames[0] == ":\n\n" and frames[-1] == "data: {}\n\n" and len(frames) >= 3


def test_sagemaker_invocations_route_dispatches_on_the_body(client):
    generate_body = {"inputs": "Hello world", "parameters": {"max_new_tokens": 3, "return_full_text": False}}
    assert client.post("/invocations", json=generate_body).json() == client.post("/", json=generate_body).json()
    chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    assert client.post("/invocations", json=chat_body).json()["object"] == "chat.completion"
    assert client.post("/invocations", json={"parameters": {}}).status_code == 422


def test_chat_tokenize_returns_the_templated_prompt(client):
    body = {"messages": [{"role": "user", "content": "hi"}]}
    response = client.post("/chat_tokenize", json=body).json()
    assert response["templated_text"].endswith("assistant\n") and "hi" in response["templated_text"]
    assert len(response["tokenize_response"]) > 3
