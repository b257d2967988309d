"""Values a QA probe sent to `serve`: each refusal names what to change, and what vLLM refuses is refused here too.

Empty and non-Unicode text, NaN and infinities, integers that are not (or not 64-bit) integers, bodies that are not
UTF-8 or JSON or nest too deeply, bounds vLLM puts on `seed` and token ids, `suffix`, a body declared larger than
the limit, unknown fields logged by name, and OpenAI's refusal parts in an assistant's turn.
"""

from __future__ import annotations

import json
import socket
import tempfile
import time

import pytest

from paged_backend.engine.sampling_params import SamplingParams
from paged_backend.errors import InvalidRequest
from tests._server_helpers import API_KEY, MODEL, server_fixture

MAX_BODY = 65536
FILES_DIR = tempfile.mkdtemp(prefix="paged-backend-bad-values-")
server = server_fixture("--num-blocks", "64", "--max-model-len", "64", "--max-request-body-bytes", str(MAX_BODY),
                        "--files-dir", FILES_DIR)  # fmt: skip

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RESPONSES = {"input": "hi", "max_output_tokens": 2}


def post_raw(server, path: str, body: bytes):
    return server.post(path, content=body, headers={"Content-Type": "application/json"})


def completion(**fields) -> bytes:
    return json.dumps({"prompt": "hi", "max_tokens": 2, **fields}).encode()  # NaN and lone surrogates survive


# (path, body, param, words the message must hold)
SAID = {
    "empty prompt": ("/v1/completions", completion(prompt=""), "prompt", "empty string"),
    "empty input": ("/v1/responses", json.dumps({"input": ""}).encode(), "input", "empty string"),
    "empty prompt in a list": ("/v1/completions", completion(prompt=["hi", ""]), "prompt.1", "empty string"),
    "lone surrogate in prompt": ("/v1/completions", completion(prompt="a\ud800b"), "prompt",
                                 "not valid Unicode (surrogates not allowed)"),
    "lone surrogate in input": ("/v1/responses", json.dumps({"input": "a\ud800b"}).encode(), "input",
                                "not valid Unicode (surrogates not allowed)"),
    "lone surrogate in a stop string": ("/v1/completions", completion(stop=["a\ud800"]), "stop.0",
                                        "not valid Unicode (surrogates not allowed)"),
    "NaN temperature": ("/v1/completions", completion(temperature=float("nan")), "temperature", "finite number"),
    "infinite top_p": ("/v1/completions", completion(top_p=float("inf")), "top_p", "finite number"),
    "NaN logit bias": ("/v1/completions", completion(logit_bias={"1": float("nan")}), "logit_bias.1",
                       "finite number"),
    "NaN chat temperature": ("/v1/chat/completions", json.dumps({**CHAT, "temperature": float("nan")}).encode(),
                             "temperature", "finite number"),
    "max_tokens 1e308": ("/v1/completions", completion(max_tokens=1e308), "max_tokens", "at most 64 bits"),
    "max_tokens 2.5": ("/v1/completions", completion(max_tokens=2.5), "max_tokens", "whole number"),
    "negative logit_bias key": ("/v1/completions", completion(logit_bias={"-1": 1}), "logit_bias", "non-negative"),
}  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param", "words"), SAID.values(), ids=SAID.keys())
def test_a_refused_value_is_named_with_what_to_change(server, path, body, param, words):
    response = post_raw(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert "fits none of the accepted forms" not in error["message"]


UNPARSED = {
    "not UTF-8": (b'{"prompt": "hi\xff"}', "not valid UTF-8: byte 0xff at position 14"),
    "nested too deeply": (b"[" * 20000 + b"]" * 20000, "nested too deeply"),
    "not JSON": (b'{"prompt": "hi", ', "not valid JSON: Expecting property name enclosed in double quotes at position"),
    "a 5000-digit number": (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "more than 4300 digits"),
}


@pytest.mark.parametrize(("body", "words"), UNPARSED.values(), ids=UNPARSED.keys())
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_a_body_that_cannot_be_parsed_says_why(server, path, body, words):
    response = post_raw(server, path, body)
    assert response.status_code == 400, response.text
    assert words in response.text and "There was an error parsing the body" not in response.text


SEEDS = {
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    "chat": ("/v1/chat/completions", CHAT),
    "responses": ("/v1/responses", RESPONSES),
}


@pytest.mark.parametrize("seed", [2**70, -(2**70), 2**63])
@pytest.mark.parametrize(("path", "body"), SEEDS.values(), ids=SEEDS.keys())
def test_a_seed_past_64_bits_is_refused_as_vllm_refuses_it(server, path, body, seed):
    response = server.post(path, json={**body, "seed": seed})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "seed" and "64 bits" in response.text
    assert server.post(path, json={**body, "seed": 2**63 - 1}).status_code == 200


@pytest.mark.parametrize("token_id", [2**70, 300])
def test_stop_token_ids_outside_the_vocabulary_are_refused(server, token_id):
    response = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "min_tokens": 2,
                                                    "stop_token_ids": [token_id]})  # fmt: skip
    assert response.status_code == 400, response.text
    assert "stop_token_ids must name token ids in [0, 256)" in response.text


def test_suffix_is_refused_as_vllm_refuses_it(server):
    response = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "suffix": "x"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "suffix" and "suffix is not currently supported" in error["message"]
    assert server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "suffix": None}).status_code == 200


def test_a_declared_body_past_the_limit_is_refused_before_it_is_sent(server):
    """Only the headers go out: the 413 comes at once, not after the server waited for a body (10 s idle)."""
    host, port = server.url.removeprefix("http://").split(":")
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: 5000000\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=5) as connection:
        started = time.monotonic()
        connection.sendall(request)
        answer = connection.recv(65536)
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert waited < 2, f"the 413 took {waited:.1f} s"


def test_each_unknown_field_name_is_logged(server):
    """Every request's unknown fields are named in the log, whatever an earlier request sent."""
    for path, body, name in [("/v1/completions", {"prompt": "hi", "max_tokens": 1}, "zz_first"),
                             ("/v1/completions", {"prompt": "hi", "max_tokens": 1}, "zz_second"),
                             ("/v1/chat/completions", CHAT, "zz_functions"),
                             ("/v1/responses", RESPONSES, "zz_prediction")]:  # fmt: skip
        assert server.post(path, json={**body, name: 1}).status_code == 200
    log = server.output()
    for name in ("zz_first", "zz_second", "zz_functions", "zz_prediction"):
        assert f"ignoring request fields this server does not implement: {name}" in log


def test_an_assistant_refusal_part_is_accepted_as_its_text(server):
    """OpenAI's assistant content parts include `refusal`; a conversation sent back with one renders its text."""
    def tokens(assistant_content):
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": assistant_content},
                    {"role": "user", "content": "why?"}]  # fmt: skip
        response = server.post("/tokenize", json={"model": MODEL, "messages": messages})
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    refused = [{"type": "refusal", "refusal": "I can't."}]
    assert tokens(refused) == tokens("I can't.")
    assert tokens([{"type": "text", "text": "Well"}, *refused]) == tokens("Well\nI can't.")
    answer = server.client().chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": refused},
                                             {"role": "user", "content": "why?"}])  # fmt: skip
    assert answer.choices[0].finish_reason in ("length", "stop")


def test_a_batch_file_with_a_line_nested_too_deeply_is_taken(server):
    """The line gets its own error; creating the batch no longer fails on it."""
    client = server.client()
    good = {"custom_id": "good", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 1}}
    text = json.dumps(good) + "\n" + "[" * 20000 + "]" * 20000 + "\n"
    uploaded = client.files.create(file=("lines.jsonl", text.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    assert batch.request_counts.total == 2


def test_the_engine_refuses_nan_and_infinite_sampling_values():
    for fields in ({"temperature": float("nan")}, {"top_p": float("nan")}, {"repetition_penalty": float("inf")},
                   {"logit_bias": {1: float("nan")}}):  # fmt: skip
        with pytest.raises(InvalidRequest, match="finite"):
            SamplingParams(**fields)
