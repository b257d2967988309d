"""A JSON schema nested too deeply for the schema checker is a 400 naming the field on every face (chat's
response_format and tools, completions' guided_json and structured_outputs, Anthropic's input_schema, Responses'
text.format, a batch line), never a 500; one nested less deeply still runs. Real clients against a real server."""

from __future__ import annotations

import json
import time

import anthropic
import openai
import pytest

from tests._server_helpers import API_KEY, MODEL, running_server

MESSAGES = [{"role": "user", "content": "x"}]
TOO_DEEP = "nested too deeply"


def nested(levels: int) -> dict:
    """An array of arrays of ... `levels` deep: the QA probe's schema."""
    schema: dict = {}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


DEEP = nested(120)  # the checker (jsonschema) recurses past Python's stack limit here


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ("--num-blocks", "256", "--max-model-len", "1024", "--files-dir", str(tmp_path_factory.mktemp("files")))
    with running_server(*flags) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}


def test_chat_response_format_too_deep_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError, match=TOO_DEEP) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                       response_format=response_format(DEEP))  # fmt: skip
    assert caught.value.body["message"].startswith("response_format.json_schema.schema: ")


def test_a_schema_nested_less_deeply_still_runs(client):
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                            response_format=response_format(nested(80)))  # fmt: skip
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_tool_parameters_too_deep_are_a_400_naming_them(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]
    with pytest.raises(openai.BadRequestError, match=TOO_DEEP) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, tools=tools,
                                       tool_choice="required")  # fmt: skip
    assert caught.value.body["param"] == "tools.0.function.parameters"


@pytest.mark.parametrize(
    "fields, named",
    [({"guided_json": DEEP}, "guided_json"), ({"guided_json": json.dumps(DEEP)}, "guided_json"),
     ({"structured_outputs": {"json": DEEP}}, "structured_outputs")],
    ids=["guided_json", "guided_json text", "structured_outputs"],
)  # fmt: skip
def test_completions_constraints_too_deep_are_a_400_naming_them(client, fields, named):
    with pytest.raises(openai.BadRequestError, match=TOO_DEEP) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=fields)
    assert caught.value.body["message"].startswith(f"{named}: ")


def test_anthropic_input_schema_too_deep_is_a_400_naming_it(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
    tools = [{"name": "f", "input_schema": {"type": "object", "properties": {"a": DEEP}}}]
    with pytest.raises(anthropic.BadRequestError, match=TOO_DEEP) as caught:
        client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=4, tools=tools, tool_choice={"type": "any"})
    assert "tools.0.input_schema" in caught.value.body["error"]["message"]


def test_responses_text_format_too_deep_is_a_400_naming_it(client):
    text = {"format": {"type": "json_schema", "name": "deep", "schema": DEEP}}
    with pytest.raises(openai.BadRequestError, match=TOO_DEEP) as caught:
        client.responses.create(model=MODEL, input="x", max_output_tokens=4, text=text)
    assert caught.value.body["message"].startswith("text.format.schema: ")


def test_a_batch_line_too_deep_is_an_error_line_with_the_400(client):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "response_format": response_format(DEEP)}
    line = {"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": body}
    uploaded = client.files.create(file=("deep.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    [error] = [json.loads(text) for text in client.files.content(batch.error_file_id).text.splitlines()]
    assert error["response"]["status_code"] == 400
    assert TOO_DEEP in error["response"]["body"]["error"]["message"]


def test_every_block_is_free_afterwards(server):
    server.wait_until_drained()
