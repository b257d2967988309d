"""Anthropic's Messages API (/v1/messages) through the real `anthropic` SDK against a real server.

The embedded model is random but greedy decoding is deterministic, so every answer is compared with what
/v1/chat/completions gives for the same conversation, token for token; tool calls come from forced tool_choice
(structured outputs), so their inputs validate against the tool's schema. Errors are checked as the SDK's typed
exceptions over Anthropic's error shape, while OpenAI's routes keep OpenAI's.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from paged_backend.engine.async_engine import EngineNotRunning
from paged_backend.server.openai_errors import install_error_handlers
from tests._server_helpers import API_KEY, MODEL, server_fixture

GREEDY = {"temperature": 0}  # the SDK leaves sampling fields to extra_body
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer",
                   "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS = [{"name": "get_weather", "description": "The forecast for a city", "input_schema": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city",
                                                "parameters": WEATHER}}]  # fmt: skip
SYSTEM = "be brief"
QUESTION = "abc def ghi"  # the tiny model answers this one with plain ASCII before anything else


server = server_fixture("--num-blocks", "256", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def chat(server, messages: list[dict], max_tokens: int, **fields) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **fields}
    response = server.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def assert_same_as_chat(message, completion: dict) -> None:
    [choice] = completion["choices"]
    assert text_of(message) == (choice["message"]["content"] or "")
    assert message.usage.output_tokens == completion["usage"]["completion_tokens"]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == completion["usage"]["prompt_tokens"]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice["finish_reason"]]


def test_create_equals_chat_completions_token_for_token(client, server):
    blocks = [{"type": "text", "text": "abc"}, {"type": "text", "text": "def ghi"}]
    turns = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi!"},
             {"role": "user", "content": blocks}]  # fmt: skip
    message = client.messages.create(model=MODEL, system=SYSTEM, messages=turns, max_tokens=24, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == MODEL and text_of(message)
    assert message.usage.cache_creation_input_tokens == 0
    chat_turns = [{"role": "system", "content": SYSTEM}, *turns[:2], {"role": "user", "content": blocks}]
    assert_same_as_chat(message, chat(server, chat_turns, 24))


def test_stream_events_come_in_order_and_join_to_the_final_message(client, server):
    arguments = dict(model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}], max_tokens=24)
    with client.messages.stream(**arguments, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events if event.type not in ("text", "input_json")]  # the SDK's own helpers
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * (len(kinds) - 5),
                     "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    deltas = [event.delta.text for event in events if event.type == "content_block_delta"]
    assert "".join(deltas) == text_of(final) and len(deltas) > 1
    whole = client.messages.create(**arguments, extra_body=GREEDY)
    assert text_of(final) == text_of(whole) and final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 24
    raw = server.post("/v1/messages", json={**arguments, "stream": True, **GREEDY})
    names = [line.removeprefix("event: ") for line in raw.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"
    assert raw.headers["content-type"].startswith("text/event-stream")


@pytest.mark.parametrize(
    "tool_choice", [{"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}]
)
def test_forced_tool_choice_answers_with_a_valid_tool_use(client, tool_choice):
    arguments = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}], max_tokens=64,
                     tools=TOOLS, tool_choice=tool_choice)  # fmt: skip
    message = client.messages.create(**arguments, extra_body=GREEDY)
    assert message.stop_reason == "tool_use"
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather" and isinstance(call.input, dict)
    jsonschema.validate(call.input, WEATHER)
    with client.messages.stream(**arguments, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    [streamed_call] = [block for block in streamed.content if block.type == "tool_use"]
    assert streamed.stop_reason == "tool_use" and streamed_call.input == call.input


@pytest.mark.parametrize(
    "tool_choice", [{"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}],
    ids=["tool", "any"],
)
def test_a_tool_use_cut_off_by_max_tokens_is_the_same_block_streamed_or_not(client, tool_choice):
    """The stream has opened a tool_use block before max_tokens cuts its input, so the whole answer holds that
    block too, its input read as far as it was written (what the SDK builds from the streamed partial_json)."""
    arguments = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=TOOLS,
                     tool_choice=tool_choice)  # fmt: skip
    full = client.messages.create(**arguments, max_tokens=64, extra_body=GREEDY)
    [full_call] = [block for block in full.content if block.type == "tool_use"]
    assert full.stop_reason == "tool_use"
    budget = full.usage.output_tokens * 3 // 4  # inside the input, past the tool's name
    message = client.messages.create(**arguments, max_tokens=budget, extra_body=GREEDY)
    with client.messages.stream(**arguments, max_tokens=budget, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    for answer in (message, streamed):
        assert answer.stop_reason == "max_tokens"
        [call] = answer.content
        assert call.type == "tool_use" and call.name == full_call.name and call.input != full_call.input
        assert call.input.items() <= full_call.input.items()
    assert message.content[0].input == streamed.content[0].input


def test_a_tool_result_round_trip_equals_chat(client, server):
    call_input = {"city": "Rome", "days": 2}
    turns = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": call_input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, sunny"},
                                     {"type": "text", "text": QUESTION}]},
    ]  # fmt: skip
    message = client.messages.create(model=MODEL, messages=turns, max_tokens=24, tools=TOOLS,
                                     tool_choice={"type": "none"}, extra_body=GREEDY)  # fmt: skip
    chat_turns = [
        turns[0],
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}],
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps(call_input)}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C, sunny"},
        {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
    ]  # fmt: skip
    assert_same_as_chat(message, chat(server, chat_turns, 24, tools=CHAT_TOOLS, tool_choice="none"))


def test_count_tokens_counts_what_a_create_sends(client):
    arguments = dict(model=MODEL, system=SYSTEM, tools=TOOLS, messages=[{"role": "user", "content": "count me"}])
    counted = client.messages.count_tokens(**arguments).input_tokens
    message = client.messages.create(**arguments, max_tokens=4, tool_choice={"type": "none"}, extra_body=GREEDY)
    usage = message.usage
    assert counted == usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens > 0
    split = [{"role": "user", "content": "count"}, {"role": "user", "content": [{"type": "text", "text": "me"}]}]
    joined = [{"role": "user", "content": [{"type": "text", "text": "count"}, {"type": "text", "text": "me"}]}]
    assert client.messages.count_tokens(model=MODEL, messages=split) == client.messages.count_tokens(
        model=MODEL, messages=joined
    )  # consecutive turns of one role are one turn


def test_a_repeated_long_prompt_reads_the_prefix_cache(client):
    long_prompt = " ".join(f"word{index}" for index in range(120))
    arguments = dict(model=MODEL, messages=[{"role": "user", "content": long_prompt}], max_tokens=4)
    first = client.messages.create(**arguments, extra_body=GREEDY).usage
    again = client.messages.create(**arguments, extra_body=GREEDY).usage
    total = first.input_tokens + first.cache_read_input_tokens
    assert again.input_tokens + again.cache_read_input_tokens == total
    assert again.cache_read_input_tokens > first.cache_read_input_tokens and again.cache_read_input_tokens > total / 2


def test_stop_sequences_and_max_tokens_set_the_stop_reason(client):
    arguments = dict(model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}])
    free = text_of(client.messages.create(**arguments, max_tokens=24, extra_body=GREEDY))
    stop = next(character for character in free[1:] if character.isascii() and character.isalnum())
    stopped = client.messages.create(**arguments, max_tokens=24, stop_sequences=[stop], extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert text_of(stopped) == free[: free.index(stop)]
    short = client.messages.create(**arguments, max_tokens=3, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.stop_sequence is None and short.usage.output_tokens == 3


def assert_anthropic_error(error: anthropic.APIStatusError, type_: str, *words: str) -> None:
    assert error.body["type"] == "error" and error.body["error"]["type"] == type_
    for word in words:
        assert word in error.body["error"]["message"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"messages": [{"role": "assistant", "content": "hi"}], "max_tokens": 4}, ["first message", "user"]),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4},
         ["'image'", "messages.0.content"]),
        ({"messages": [{"role": "user", "content": "hi"}]}, ["'max_tokens' is required"]),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}], "max_tokens": 4},
         ["'messages.0.content.0.text", "required"]),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}],
          "max_tokens": 4}, ["toolu_x", "answers no tool_use"]),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": TOOLS},
         ["--enable-auto-tool-choice"]),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, ["max_tokens=5000"]),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tool_choice": {"type": "any"}},
         ['tool_choice {"type": "any"} needs \'tools\'']),
    ],
    ids=["wrong-role-order", "unknown-block", "no-max-tokens", "block-without-text", "unanswered-result", "auto-tools",
         "past-context", "any-without-tools"],
)  # fmt: skip
def test_bad_input_gets_a_bad_request_in_anthropic_shape(client, server, body, words):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.post("/v1/messages", cast_to=anthropic.types.Message, body={"model": MODEL, **body})
    assert_anthropic_error(caught.value, "invalid_request_error", *words)
    server.wait_until_drained()


def test_unknown_model_route_and_method_get_anthropic_not_found(client, server):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-nowhere", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert_anthropic_error(caught.value, "not_found_error", "claude-nowhere")
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.post("/v1/messages/nowhere", cast_to=object, body={})
    assert_anthropic_error(caught.value, "not_found_error")
    wrong_method = httpx.get(f"{server.url}/v1/messages", headers={"x-api-key": API_KEY})
    assert wrong_method.status_code == 405 and wrong_method.headers["Allow"] == "POST"
    assert wrong_method.json()["type"] == "error"


def test_x_api_key_is_accepted_and_a_wrong_key_is_an_authentication_error(server, monkeypatch):
    for variable in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    by_header = anthropic.Anthropic(base_url=server.url, default_headers={"x-api-key": API_KEY}, max_retries=0)
    assert by_header.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}]).input_tokens
    for client in (anthropic.Anthropic(base_url=server.url, default_headers={"x-api-key": "wrong"}, max_retries=0),
                   anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)):  # fmt: skip
        with pytest.raises(anthropic.AuthenticationError) as caught:
            client.messages.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert_anthropic_error(caught.value, "authentication_error", "API key")


def test_openai_routes_keep_openai_error_shape(server):
    response = server.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert response.status_code == 400
    assert set(response.json()) == {"error"} and set(response.json()["error"]) == {"message", "type", "param", "code"}


class _Asleep(EngineNotRunning):
    retry_after = 7


def test_an_error_with_retry_after_gets_the_header_in_either_shape():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/messages")
    @app.post("/v1/chat/completions")
    async def asleep() -> None:
        raise _Asleep("asleep; retry later")

    with TestClient(app) as test_client:
        anthropic_answer = test_client.post("/v1/messages")
        openai_answer = test_client.post("/v1/chat/completions")
    assert anthropic_answer.status_code == openai_answer.status_code == 503
    assert anthropic_answer.headers["Retry-After"] == openai_answer.headers["Retry-After"] == "7"
    assert anthropic_answer.json() == {"type": "error", "error": {"type": "overloaded_error",
                                                                  "message": "asleep; retry later"}}  # fmt: skip
    assert openai_answer.json()["error"]["code"] == "service_unavailable"


def test_a_wrong_method_names_the_methods_of_every_route_of_the_path():
    app = FastAPI()
    install_error_handlers(app)
    app.get("/v1/messages/{message_id}")(lambda message_id: {})
    app.delete("/v1/messages/{message_id}")(lambda message_id: {})
    app.get("/v1/things")(lambda: {})
    app.post("/v1/things")(lambda: {})
    with TestClient(app) as test_client:
        anthropic_answer, openai_answer = test_client.put("/v1/messages/1"), test_client.options("/v1/things")
    assert anthropic_answer.status_code == openai_answer.status_code == 405
    assert anthropic_answer.headers["Allow"] == "DELETE, GET" and openai_answer.headers["Allow"] == "GET, POST"
    assert anthropic_answer.json()["type"] == "error" and openai_answer.json()["error"]["code"] == "method_not_allowed"
