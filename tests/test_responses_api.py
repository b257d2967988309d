"""/v1/responses through the real `openai` client against a real server: plain, streamed, continued, with tools,
parsed into a pydantic model, stored (GET, DELETE, cancel, input_items) and bounded, and refused by name.

The embedded model is random, so the tests compare paths rather than judge text: greedy Responses output equals
greedy chat completions output for the same conversation, a streamed answer equals the one not streamed, and tool
calls come from tool_choice's constraints.
"""

from __future__ import annotations

import json
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from paged_backend.server.responses_store import ResponseStore, credential_owner
from tests._server_helpers import API_KEY, MODEL, client_fixture, server_fixture

MAX_STORED = 6
SECOND_KEY = "second-tenant-key"  # a second --api-key: its stored responses are its own
server = server_fixture(
    "--num-blocks", "256", "--max-model-len", "1024", "--max-stored-responses", str(MAX_STORED),
    "--api-key", SECOND_KEY,
)  # fmt: skip
client = client_fixture()
AUTHORIZATION = {"Authorization": f"Bearer {API_KEY}"}

INSTRUCTIONS = "You are a terse assistant. Answer in one short sentence, and never use lists or headings."
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },  # fmt: skip
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The forecast for a city", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}},
]


def respond(client, **fields):
    arguments = {"model": MODEL, "instructions": INSTRUCTIONS, "max_output_tokens": 12, "temperature": 0, **fields}
    return client.responses.create(**arguments)


def chat_text(client, messages, max_tokens=12):
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return chat.choices[0].message.content, chat.usage


def test_greedy_text_equals_chat_completions_token_for_token(client):
    response = respond(client, input="What is the capital of France?")
    text, usage = chat_text(client, [{"role": "system", "content": INSTRUCTIONS},
                                     {"role": "user", "content": "What is the capital of France?"}])  # fmt: skip
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == text
    assert response.usage.output_tokens == usage.completion_tokens
    assert response.usage.input_tokens == usage.prompt_tokens
    assert response.usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.instructions == INSTRUCTIONS and response.max_output_tokens == 12


def test_item_list_input_equals_the_same_chat_conversation(client):
    items = [
        {"role": "developer", "content": "Prefer metric units."},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "How tall"}, {"type": "input_text", "text": "is it?"}],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Which one?"}]},
        {"role": "user", "content": "The Eiffel tower."},
    ]
    response = respond(client, input=items)
    text, _ = chat_text(client, [{"role": "system", "content": INSTRUCTIONS},
                                 {"role": "developer", "content": "Prefer metric units."},
                                 {"role": "user", "content": "How tall\nis it?"},
                                 {"role": "assistant", "content": "Which one?"},
                                 {"role": "user", "content": "The Eiffel tower."}])  # fmt: skip
    assert response.output_text == text


def test_the_output_budget_running_out_makes_it_incomplete(client):
    response = respond(client, input="Tell me a long story.", max_output_tokens=5, extra_body={"ignore_eos": True})
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5 and response.output[0].status == "incomplete"


def test_stream_sends_typed_events_in_order_and_its_deltas_join_to_the_text(client):
    whole = respond(client, input="Name a colour.", max_output_tokens=16)
    events = list(respond(client, input="Name a colour.", max_output_tokens=16, stream=True))
    types = [event.type for event in events]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * len(deltas), "response.output_text.done", "response.content_part.done",
        "response.output_item.done", f"response.{whole.status}",
    ]  # fmt: skip
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(delta.delta for delta in deltas)
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert all(delta.item_id == final.output[0].id for delta in deltas)


def test_previous_response_id_continues_the_conversation_from_the_prefix_cache(client):
    first = respond(client, input="My name is Ada. Remember it.", max_output_tokens=8)
    second = respond(client, input="What is my name?", previous_response_id=first.id, max_output_tokens=8)
    text, usage = chat_text(client, [
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "My name is Ada. Remember it."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"},
    ], max_tokens=8)  # fmt: skip
    assert second.previous_response_id == first.id
    assert second.output_text == text and second.usage.input_tokens == usage.prompt_tokens
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_a_forced_call_gives_a_function_call_item_whose_output_round_trips(client):
    called = respond(client, input="Weather in Rome?", tools=TOOLS, max_output_tokens=64,
                     tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "sunny"}'}
    answered = respond(client, input=[result], previous_response_id=called.id, tools=TOOLS, tool_choice="none")
    assert answered.status in ("completed", "incomplete") and answered.output[0].type == "message"
    # The same turn sent whole (items, not the stored conversation) reads the same prompt.
    resent = [{"role": "user", "content": "Weather in Rome?"}, call.model_dump(exclude_none=True), result]
    again = respond(client, input=resent, tools=TOOLS, tool_choice="none")
    assert again.output_text == answered.output_text and again.usage.input_tokens == answered.usage.input_tokens


def test_required_calls_stream_their_arguments(client):
    events = list(respond(client, input="Weather?", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                          max_output_tokens=64, stream=True))  # fmt: skip
    final = events[-1].response
    [call] = final.output
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == done.arguments == call.arguments and done.item_id == call.id
    assert [e.type for e in events][2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert call.name in ("get_weather", "get_time") and isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}],
                         ids=["required", "named"])  # fmt: skip
def test_a_call_cut_off_by_the_budget_is_an_incomplete_function_call_streamed_or_not(client, tool_choice):
    fields = dict(input="Weather?", tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
    whole = respond(client, max_output_tokens=64, **fields)
    [full], budget = whole.output, whole.usage.output_tokens * 2 // 3  # cut inside the arguments
    cut = respond(client, max_output_tokens=budget, **fields)
    final = list(respond(client, max_output_tokens=budget, stream=True, **fields))[-1].response
    for response in (cut, final):
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        [call] = response.output
        assert call.type == "function_call" and call.status == "incomplete" and call.name == full.name
        assert full.arguments.startswith(call.arguments) and call.arguments != full.arguments
    assert final.output[0].arguments == cut.output[0].arguments


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=9)


def test_parse_returns_the_pydantic_model(client):
    parsed = client.responses.parse(model=MODEL, input="Is the sky blue?", text_format=Verdict, max_output_tokens=200,
                                    temperature=0)  # fmt: skip
    assert isinstance(parsed.output_parsed, Verdict)
    assert parsed.text.format.type == "json_schema"


def test_the_sdk_stream_helper_accumulates_a_parsed_final_response(client):
    arguments = {"model": MODEL, "input": "Is the sky blue?", "max_output_tokens": 200, "temperature": 0}
    with client.responses.stream(text_format=Verdict, **arguments) as stream:
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_parsed == client.responses.parse(text_format=Verdict, **arguments).output_parsed


def test_a_stored_response_can_be_read_listed_and_deleted(client):
    response = respond(client, input="Hello", metadata={"run": "7"}, user="tester")
    fetched = client.responses.retrieve(response.id)
    assert fetched.model_dump() == response.model_dump()
    assert fetched.metadata == {"run": "7"} and fetched.user == "tester"
    items = client.responses.input_items.list(response.id, order="asc")
    assert [item.content[0].text for item in items.data] == ["Hello"]
    with pytest.raises(openai.BadRequestError, match="only a background response"):
        client.responses.cancel(response.id)
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    not_stored = respond(client, input="Hello", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(not_stored.id)


def test_a_background_response_runs_to_the_end_or_until_cancelled(client):
    foreground = respond(client, input="Count to three.", max_output_tokens=16)
    background = respond(client, input="Count to three.", max_output_tokens=16, background=True)
    assert background.status == "in_progress" and background.background
    deadline = time.monotonic() + 60
    while (polled := client.responses.retrieve(background.id)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert polled.output_text == foreground.output_text
    with pytest.raises(openai.BadRequestError, match=f"already {polled.status}"):
        client.responses.cancel(background.id)
    endless = respond(client, input="Go on forever.", max_output_tokens=800, background=True,
                     extra_body={"ignore_eos": True})  # fmt: skip
    cancelled = client.responses.cancel(endless.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(endless.id).status == "cancelled"


def test_a_background_response_streams_its_events_again_from_any_point(client):
    """GET ?stream=true replays a background response's events (`starting_after` a sequence number) and follows
    one still running; background with stream=true streams the same events from the start."""
    arguments = dict(input="Count to three.", max_output_tokens=16)
    foreground = respond(client, **arguments)
    streamed = list(respond(client, stream=True, background=True, **arguments))
    assert [event.sequence_number for event in streamed] == list(range(len(streamed)))
    final = streamed[-1].response
    assert final.background and final.output_text == foreground.output_text and final.status == foreground.status
    replayed = list(client.responses.retrieve(final.id, stream=True))
    assert [event.model_dump() for event in replayed] == [event.model_dump() for event in streamed]
    later = list(client.responses.retrieve(final.id, stream=True, starting_after=3))
    assert [event.model_dump() for event in later] == [event.model_dump() for event in streamed[4:]]
    running = respond(client, background=True, input="Go on forever.", max_output_tokens=400,
                      extra_body={"ignore_eos": True})  # fmt: skip
    events = client.responses.retrieve(running.id, stream=True)
    deltas = 0
    for event in events:
        deltas += event.type == "response.output_text.delta"
        if deltas == 3:
            client.responses.cancel(running.id)  # the stream ends with the run
    assert deltas >= 3 and client.responses.retrieve(running.id).status == "cancelled"


def test_only_a_background_response_streams_from_get(server, client):
    stored = respond(client, input="Hello", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="only a background response") as caught:
        list(client.responses.retrieve(stored.id, stream=True))
    assert caught.value.body["param"] == "stream"
    fetched = httpx.get(f"{server.url}/v1/responses/{stored.id}?starting_after=2", headers=AUTHORIZATION)
    assert fetched.status_code == 400 and fetched.json()["error"]["param"] == "starting_after"
    assert "stream=true" in fetched.json()["error"]["message"]


def test_the_store_keeps_only_the_newest(client):
    ids = [respond(client, input="Hi", max_output_tokens=1).id for _ in range(MAX_STORED + 1)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


def test_the_store_forgets_expired_responses_and_isolates_owners():
    now = [0.0]
    store = ResponseStore(max_entries=10, ttl=60, clock=lambda: now[0])
    alice = credential_owner({"authorization": "Bearer alice-key"}, api_key_configured=True)
    bob = credential_owner({"x-api-key": "bob-key"}, api_key_configured=True)
    assert alice == credential_owner({"x-api-key": "alice-key"}, api_key_configured=True) != bob
    assert "alice-key" not in alice  # a hash, never the key
    store.put(alice, "resp_1", "answer")
    assert store.get(bob, "resp_1") is None and not store.delete(bob, "resp_1")
    assert store.get(alice, "resp_1") == "answer"
    now[0] = 61
    assert store.get(alice, "resp_1") is None and len(store) == 0
    assert credential_owner({"authorization": "Bearer x"}, False) == credential_owner({}, False)


def test_another_header_with_the_same_key_reads_the_same_space(server, client):
    response = respond(client, input="Hi", max_output_tokens=1)
    fetched = httpx.get(f"{server.url}/v1/responses/{response.id}", headers={"x-api-key": API_KEY})
    assert fetched.status_code == 200 and fetched.json()["id"] == response.id


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "input[0]: an input item's type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role"),
        ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]}, None, "no function_call"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0", "tool type 'web_search' is not supported"),
        ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, None, "'nope'"),
        ({"input": "x", "previous_response_id": "resp_missing"}, "previous_response_id", "does not exist"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, None, 'needs "schema"'),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
         None, "text.format.schema is not a valid JSON schema"),
        ({"input": "x", "background": True, "store": False}, "background", "needs store=true"),
        ({"input": "x", "max_output_tokens": 5000}, "prompt", "context"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, fields, param, words):
    response = server.post("/v1/responses", json={"model": MODEL, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"


def test_an_unknown_id_is_a_404_in_openai_shape(server):
    for method, path in [("GET", ""), ("DELETE", ""), ("POST", "/cancel"), ("GET", "/input_items")]:
        response = httpx.request(method, f"{server.url}/v1/responses/resp_unknown{path}", headers=AUTHORIZATION)
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "not_found"
    server.wait_until_drained()


def test_each_api_key_reads_only_its_own_stored_responses(server):
    alice = server.client()
    bob = openai.OpenAI(base_url=f"{server.url}/v1", api_key=SECOND_KEY, max_retries=0, timeout=120)
    mine = alice.responses.create(model=MODEL, input="Hello", max_output_tokens=4, temperature=0)
    assert alice.responses.retrieve(mine.id).id == mine.id
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(mine.id)
    with pytest.raises(openai.BadRequestError, match="does not exist"):  # OpenAI: a 400 on previous_response_id
        bob.responses.create(model=MODEL, input="Hi", max_output_tokens=4, previous_response_id=mine.id)
    theirs = bob.responses.create(model=MODEL, input="Hello", max_output_tokens=4, temperature=0)
    assert bob.responses.retrieve(theirs.id).output_text == mine.output_text  # both keys are served alike
    stranger = openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-a-key", max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError):
        stranger.responses.create(model=MODEL, input="Hello", max_output_tokens=4)
