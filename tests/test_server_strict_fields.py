"""`serve --strict-fields`: fields the server does not know are a 400 naming them, as before vLLM's policy."""

from __future__ import annotations

import openai
import pytest

from tests._server_helpers import MODEL, server_fixture

server = server_fixture("--strict-fields", "--num-blocks", "64", "--max-model-len", "64")


def error_of(response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_an_unknown_field_is_a_400_naming_it(server):
    error = error_of(server.post("/v1/completions", json={"prompt": "hi", "best_of_luck": 3}))
    assert error["param"] == "best_of_luck" and "'best_of_luck'" in error["message"]
    assert "--strict-fields" in error["message"]


def test_an_unknown_nested_key_is_named_with_its_path(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True, "zork": 1}}
    error = error_of(server.post("/v1/chat/completions", json=body))
    assert error["param"] == "stream_options.zork"


def test_every_known_vllm_field_still_passes(server):
    completion = server.client().completions.create(
        model=MODEL, prompt="hi", max_tokens=2, user="u", seed=1,
        extra_body={"ignore_eos": True, "min_tokens": 1, "top_k": 5, "request_id": "r", "priority": 0,
                    "include_stop_str_in_output": False, "spaces_between_special_tokens": True,
                    "guided_decoding_backend": "xgrammar", "return_tokens_as_token_ids": False},
    )  # fmt: skip
    assert completion.usage.completion_tokens == 2


def test_the_openai_client_sees_a_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        server.client().completions.create(model=MODEL, prompt="hi", extra_body={"frobnicate": True})
    server.wait_until_drained()
