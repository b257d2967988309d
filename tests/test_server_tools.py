"""Tool calling on /v1/chat/completions through the real `openai` client against a real server.

The embedded model is random, so calls come from constraints, not from its judgement: tool_choice "required"
and named choices are enforced with structured outputs (the arguments must validate against the function's
parameters, streamed or not), and for "auto" a regex constraint scripts the Hermes text the server then parses.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests._server_helpers import MODEL, client_fixture, server_fixture

PARAMETERS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "get_time": {
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in PARAMETERS.items()]
MESSAGES = [{"role": "user", "content": "What is the weather in Rome?"}]


server = server_fixture(
    "--num-blocks", "256", "--max-model-len", "1024", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"
)


client = client_fixture()


def chat(client, **kwargs):
    arguments = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=400, temperature=1.0, seed=5)
    return client.chat.completions.create(**{**arguments, **kwargs})


def streamed_calls(chunks) -> tuple[str, list[dict], list[str]]:
    """Content, calls and finish reasons reassembled from stream chunks, as an OpenAI client accumulates them."""
    content, calls, finish = "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.type == "function" and call.function.name, "a call's first delta names it"
                    calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                calls[call.index]["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    return content, [calls[index] for index in sorted(calls)], finish


def assert_valid_call(name: str, arguments: str, call_id: str) -> None:
    assert call_id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_required_returns_calls_whose_arguments_validate(client):
    answer = chat(client, tool_choice="required")
    [choice] = answer.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function"
        assert_valid_call(call.function.name, call.function.arguments, call.id)


def test_required_streamed_equals_the_whole_answer(client):
    whole = chat(client, tool_choice="required", seed=8).choices[0].message.tool_calls
    content, calls, finish = streamed_calls(chat(client, tool_choice="required", seed=8, stream=True))
    assert content == "" and finish == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in whole]
    for call in calls:
        assert_valid_call(call["name"], call["arguments"], call["id"])


def test_required_without_parallel_calls_makes_exactly_one(client):
    for seed in (1, 2, 3):
        assert len(chat(client, tool_choice="required", parallel_tool_calls=False, seed=seed).choices[0].message
                   .tool_calls) == 1  # fmt: skip


NAMED = {"type": "function", "function": {"name": "get_time"}}


def test_named_choice_calls_that_function_with_valid_arguments(client):
    [choice] = chat(client, tool_choice=NAMED).choices
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time" and choice.message.content is None
    assert_valid_call("get_time", call.function.arguments, call.id)
    assert choice.finish_reason == "stop"  # vLLM ends a named call as the engine did, not with "tool_calls"


def test_named_choice_streamed(client):
    content, [call], finish = streamed_calls(chat(client, tool_choice=NAMED, stream=True))
    assert content == "" and call["name"] == "get_time" and finish == ["stop"]
    assert_valid_call("get_time", call["arguments"], call["id"])


# What a Qwen-style model would write; the regex makes the random model write exactly this shape.
HERMES_REGEX = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome|Oslo)", "days": [1-7]\}\}\n</tool_call>'  # noqa: E501


def auto_chat(client, **kwargs):
    return chat(client, tool_choice="auto", extra_body={"structured_outputs": {"regex": HERMES_REGEX}}, **kwargs)


def test_auto_parses_the_calls_the_model_wrote(client):
    [choice] = auto_chat(client).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert_valid_call("get_weather", call.function.arguments, call.id)


def test_auto_streamed_sends_content_then_call_deltas(client):
    chunks = list(auto_chat(client, stream=True))
    content, [call], finish = streamed_calls(chunks)
    assert content == "Checking.\n" and finish == ["tool_calls"]
    assert call["name"] == "get_weather" and re.fullmatch(r'\{"city": "\w+", "days": \d\}', call["arguments"])
    fragments = [c for chunk in chunks for choice in chunk.choices for c in choice.delta.tool_calls or []]
    assert len(fragments) > 2, "arguments arrive in fragments as the model writes them"
    assert "<tool_call>" not in content


def test_auto_with_plain_text_answers_content(client):
    [choice] = chat(
        client, tool_choice="auto", max_tokens=8, extra_body={"structured_outputs": {"regex": "Hello"}}
    ).choices
    assert choice.message.content == "Hello" and choice.message.tool_calls is None and choice.finish_reason == "stop"


def test_none_leaves_the_text_alone(client):
    [choice] = chat(client, tool_choice="none", max_tokens=8).choices
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")


BAD = {
    "tool without a name": ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "name"),
    "tool parameters not a schema": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}, "schema"),
    "tool parameters with a bad $schema": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$schema": []}}}]}, "$schema"),
    "two tools with one name": ({"tools": [TOOLS[0], TOOLS[0]]}, "distinct"),
    "named function missing": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "get_stock"),
    "tool_choice without tools": ({"tool_choice": "required"}, "tools"),
    "unknown tool_choice": ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    "required and a malformed response_format": (
        {"tools": TOOLS, "tool_choice": "required",
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        "response_format"),
}  # fmt: skip


ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
    "additionalProperties": False}}}  # fmt: skip


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_call_wins_over_response_format(client, tool_choice):
    """vLLM's rule, which agents rely on (they send their output type's format on every turn): the tool-call
    constraint applies, the format waits for a turn that answers in text. Same seed, so the same call."""
    plain = chat(client, tool_choice=tool_choice, seed=8).choices[0]
    [choice] = chat(client, tool_choice=tool_choice, seed=8, response_format=ANSWER_FORMAT).choices
    assert choice.finish_reason == plain.finish_reason and choice.message.content is None
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    assert calls == [(call.function.name, call.function.arguments) for call in plain.message.tool_calls]
    for call in choice.message.tool_calls:
        assert_valid_call(call.function.name, call.function.arguments, call.id)
    content, streamed, finish = streamed_calls(
        chat(client, tool_choice=tool_choice, seed=8, response_format=ANSWER_FORMAT, stream=True))
    assert content == "" and [(c["name"], c["arguments"]) for c in streamed] == calls
    assert finish == [choice.finish_reason]


def cut_points(client, **kwargs) -> tuple[list[tuple[str, str]], list[int]]:
    """The calls of the answer left to finish, and max_tokens values that cut it at a third, two thirds and one
    token short of its end."""
    whole = chat(client, **kwargs)
    assert whole.choices[0].finish_reason in ("tool_calls", "stop")
    calls = [(call.function.name, call.function.arguments) for call in whole.choices[0].message.tool_calls]
    length = whole.usage.completion_tokens
    return calls, [length // 3, 2 * length // 3, length - 1]


TRUNCATED = {
    "required": {"tool_choice": "required"},
    "named": {"tool_choice": NAMED},
    "auto (hermes)": {"tool_choice": "auto", "extra_body": {"structured_outputs": {"regex": HERMES_REGEX}}},
}


@pytest.mark.parametrize("fields", TRUNCATED.values(), ids=TRUNCATED.keys())
def test_a_call_cut_off_by_max_tokens_finishes_with_length_streamed_or_not(client, fields):
    """A call max_tokens cut short is reported as "length" (not "tool_calls"), and the whole answer says what the
    stream said: the same content, and the same calls with their arguments as far as they were written."""
    full_calls, cuts = cut_points(client, **fields)
    cut_inside_arguments = 0
    for max_tokens in cuts:
        [choice] = chat(client, max_tokens=max_tokens, **fields).choices
        whole = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]
        content, calls, finish = streamed_calls(chat(client, max_tokens=max_tokens, stream=True, **fields))
        assert choice.finish_reason == "length" and finish == ["length"]
        assert (choice.message.content or "", whole) == (content, [(c["name"], c["arguments"]) for c in calls])
        pairs = list(zip(whole, full_calls, strict=False))  # the cut may come before some calls began
        assert all(name == full_name and full.startswith(arguments) for (name, arguments), (full_name, full) in pairs)
        cut_inside_arguments += any(arguments != full for (_, arguments), (_, full) in pairs)
    assert cut_inside_arguments, "some cut lands inside a call's arguments"


@pytest.mark.parametrize("body, named", BAD.values(), ids=BAD.keys())
def test_bad_tool_requests_get_a_400_naming_the_problem(server, body, named):
    response = server.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]


def test_every_block_is_free_afterwards(server):
    server.wait_until_drained()
