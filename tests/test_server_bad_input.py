"""Bad input gets a 4xx with an OpenAI error object, never a 500, and the server keeps serving."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests._server_helpers import API_KEY, MODEL, server_fixture

MAX_BODY = 4096
MAX_CONCURRENT = 3
MAX_MODEL_LEN = 64
LONG_MODEL_LEN = 2048  # the tiny model's positions; the concurrency test's streams must outlast its check


server = server_fixture(
    "--num-blocks", "64", "--max-model-len", str(MAX_MODEL_LEN), "--max-request-body-bytes", str(MAX_BODY),
    "--max-concurrent-requests", str(MAX_CONCURRENT),
)  # fmt: skip
long_lived_server = server_fixture(
    "--num-blocks", str(MAX_CONCURRENT * LONG_MODEL_LEN // 16 + 16), "--max-model-len", str(LONG_MODEL_LEN),
    "--max-concurrent-requests", str(MAX_CONCURRENT),
)  # fmt: skip


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


def assert_still_serving(server) -> None:
    completion = server.client().completions.create(model=MODEL, prompt="ok", max_tokens=2)
    assert completion.choices[0].finish_reason in ("length", "stop")


BAD_BODIES = {
    "malformed json": b'{"prompt": "hi", ',
    "not an object": b"[1, 2, 3]",
    "empty body": b"",
    "prompt missing": b"{}",
    "prompt wrong type": json.dumps({"prompt": {"text": "hi"}}).encode(),
    "max_tokens as string": json.dumps({"prompt": "hi", "max_tokens": "5"}).encode(),
    "max_tokens negative": json.dumps({"prompt": "hi", "max_tokens": -1}).encode(),
    "max_tokens huge": json.dumps({"prompt": "hi", "max_tokens": 10**30}).encode(),
    "temperature negative": json.dumps({"prompt": "hi", "temperature": -0.5}).encode(),
    "top_p zero": json.dumps({"prompt": "hi", "top_p": 0}).encode(),
    "n zero": json.dumps({"prompt": "hi", "n": 0}).encode(),
    "stream not bool": json.dumps({"prompt": "hi", "stream": "yes"}).encode(),
    "empty stop string": json.dumps({"prompt": "hi", "stop": [""]}).encode(),
    "empty prompt": json.dumps({"prompt": ""}).encode(),
    "empty prompt list": json.dumps({"prompt": []}).encode(),
    "token id out of vocab": json.dumps({"prompt": [1, 2, 10**6]}).encode(),
    "min_tokens above max_tokens": json.dumps({"prompt": "hi", "min_tokens": 9, "max_tokens": 2}).encode(),
    "empty string in a prompt list": json.dumps({"prompt": ["hi", ""]}).encode(),
    "max_tokens zero without echo": json.dumps({"prompt": "hi", "max_tokens": 0}).encode(),
    "stream_options without stream": json.dumps({"prompt": "hi", "stream_options": {"include_usage": True}}).encode(),
    "min_tokens with only stop tokens allowed": json.dumps(
        {"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "allowed_token_ids": [5], "stop_token_ids": [5]}
    ).encode(),
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_completion_bodies_get_400(server, body):
    response = server.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert_openai_error(response, 400)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages"])
def test_a_json_body_sent_as_text_plain_is_told_the_content_type(server, path):
    body = {"model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = server.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "text/plain"})
    assert response.status_code == 400, response.text
    assert "Content-Type: application/json, not text/plain" in response.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("field", [{"chat_template": "{{ 'x' * 10**9 }}"},
                                   {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}])  # fmt: skip
def test_a_request_s_own_chat_template_is_refused_unless_the_server_trusts_them(server, path, field):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **field}
    response = server.post(path, json=body)
    assert response.status_code == 400, response.text
    assert "--trust-request-chat-template" in response.text


def test_unknown_field_is_ignored_not_refused(server):
    """vLLM's policy: a field the server does not know is logged and ignored (--strict-fields refuses it)."""
    response = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "best_of_luck": 3})
    assert response.status_code == 200, response.text


def test_a_value_of_no_accepted_form_names_its_field_once(server):
    error = assert_openai_error(server.post("/v1/completions", json={"prompt": {"text": "hi"}}), 400)
    assert error["param"] == "prompt" and "list[str]" in error["message"] and "list[list[int]]" in error["message"]


@pytest.mark.parametrize(
    "body, named",
    [({"prompt": "hi", "stop": ["x"] * 20}, ("stop", "at most 16 items")),
     ({"prompt": ["hi"] * 65}, ("prompt", "at most 64 items")),
     ({"prompt": "hi", "stream_options": {"include_usage": True}}, ("stream_options", "stream=true"))],
    ids=["20 stop strings", "65 prompts", "stream_options without stream"],
)  # fmt: skip
def test_the_error_names_the_field_and_what_to_change(server, body, named):
    error = assert_openai_error(server.post("/v1/completions", json=body), 400)
    assert error["param"] == named[0] and named[1] in error["message"]


@pytest.mark.parametrize(
    "body",
    [{"messages": []}, {"messages": [{"role": "robot", "content": "hi"}]}, {"messages": "hi"},
     {"messages": [{"role": "user"}]}, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 99},
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}],
    ids=["no messages", "unknown role", "messages not a list", "content missing", "top_logprobs too high",
         "top_logprobs without logprobs"],
)  # fmt: skip
def test_bad_chat_bodies_get_400(server, body):
    assert_openai_error(server.post("/v1/chat/completions", json=body), 400)


def test_prompt_longer_than_the_context_is_context_length_exceeded(server):
    error = assert_openai_error(server.post("/v1/completions", json={"prompt": "x" * (MAX_MODEL_LEN + 5)}), 400)
    assert error["code"] == "context_length_exceeded"
    fits_alone = {"prompt": "x" * (MAX_MODEL_LEN - 10), "max_tokens": 20}
    assert (
        assert_openai_error(server.post("/v1/completions", json=fits_alone), 400)["code"] == "context_length_exceeded"
    )


def test_the_openai_client_sees_a_bad_request_error(server):
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="not-this-one", prompt="hi")
    assert_still_serving(server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_a_lone_surrogate_in_the_model_name_gets_a_4xx_not_500(server, path):
    """The 404 quotes the name, and a lone surrogate cannot be UTF-8: the error is ASCII JSON with its escape
    (Anthropic's route refuses the name as a string first: 400)."""
    body = {"model": "\ud800", "prompt": "hi", "input": "hi", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    response = server.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert response.status_code == (400 if path == "/v1/messages" else 404), response.text
    assert response.json()["error"]["message"]
    assert_still_serving(server)


def test_oversized_body_gets_413(server):
    response = server.post("/v1/completions", json={"prompt": "x" * (MAX_BODY * 2)})
    assert_openai_error(response, 413)
    assert_still_serving(server)


def test_missing_or_wrong_api_key_gets_401(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert assert_openai_error(response, 401)["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key


def test_unknown_route_and_wrong_method_get_openai_errors(server):
    assert_openai_error(httpx.get(f"{server.url}/nowhere"), 404)
    assert_openai_error(httpx.get(f"{server.url}/v1/engines", headers={"Authorization": f"Bearer {API_KEY}"}), 404)
    wrong_method = server.post("/v1/models", json={})
    assert_openai_error(wrong_method, 405)
    assert wrong_method.headers["Allow"] == "GET"  # RFC 9110: a 405 lists the methods the path takes


def test_requests_past_the_concurrency_limit_get_429(long_lived_server):
    """Hold MAX_CONCURRENT streams open, then one more is refused; once their clients leave, requests pass again.

    The held streams ask for thousands of tokens (seconds of work), so they are still generating when the extra
    request comes: a short stream could finish server-side, its bytes in the socket's buffers, before the check."""
    server = long_lived_server
    holding, release = threading.Barrier(MAX_CONCURRENT + 1), threading.Event()
    body = {"prompt": "hold", "max_tokens": LONG_MODEL_LEN - 8, "stream": True, "ignore_eos": True}

    def hold_a_stream():
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as response:  # fmt: skip
            lines = response.iter_lines()
            next(lines)
            holding.wait()
            release.wait()  # then the client leaves mid-stream, and the server aborts the request

    threads = [threading.Thread(target=hold_a_stream) for _ in range(MAX_CONCURRENT)]
    for thread in threads:
        thread.start()
    holding.wait()
    try:
        refused = server.post("/v1/completions", json={"prompt": "one more"})
        error = assert_openai_error(refused, 429)
        assert error["code"] == "rate_limit_exceeded" and refused.headers["retry-after"] == "1"  # the SDK's wait
        assert server.metrics()["paged_backend:num_requests_running"] == MAX_CONCURRENT  # the holders were running
    finally:
        release.set()
        for thread in threads:
            thread.join()
    deadline = time.monotonic() + 30  # the server notices the departures within a step or two
    while (response := server.post("/v1/completions", json={"prompt": "again", "max_tokens": 2})).status_code == 429:
        assert time.monotonic() < deadline, "the slots of the clients that left were never freed"
        time.sleep(0.05)
    assert response.status_code == 200, response.text
    metrics = server.wait_until_drained()
    assert metrics["paged_backend:generation_tokens_total"] < MAX_CONCURRENT * (LONG_MODEL_LEN - 8)  # aborted early


def test_schema_fuzzing_never_gets_a_server_error(server):
    # Plain API rather than schemathesis' pytest plugin, which breaks across pytest releases.
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert operations
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def never_a_server_error(case):
            case.call_and_validate(headers={"Authorization": f"Bearer {API_KEY}"}, checks=[not_a_server_error],
                                   timeout=60)  # fmt: skip

        never_a_server_error()


def test_server_is_healthy_and_drained_after_all_of_it(server):
    assert_still_serving(server)
    server.wait_until_drained()
