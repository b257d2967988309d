"""Structured outputs through a real `paged-backend serve` and the openai client: outputs validate, streamed or not,
many at once; bad constraints are 400s that name the problem; KV blocks drain afterwards.

Schemas bound their strings and arrays so a random-weight model always completes them (see test_structured_engine).
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests._server_helpers import MODEL, running_server

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 2, "items": {"enum": ["cat", "dog", "fish"]}}}}


@pytest.fixture(scope="module")
def server():
    with running_server("--num-blocks", "512", "--max-model-len", "1024") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_chat_response_format_json_schema_validates(client, server):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], max_tokens=400, temperature=1.0,
        seed=3, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    server.wait_until_drained()


def test_completions_regex_and_choice_via_vllm_fields(client, server):
    regex = client.completions.create(model=MODEL, prompt="Code:", max_tokens=50, temperature=1.0, seed=1,
                                      extra_body={"structured_outputs": {"regex": r"[A-Z]{2}\d{3}"}})
    assert re.fullmatch(r"[A-Z]{2}\d{3}", regex.choices[0].text)
    choice = client.completions.create(model=MODEL, prompt="Mood:", max_tokens=50, temperature=1.0, seed=2, n=3,
                                       extra_body={"guided_choice": ["happy", "sad"]})
    assert [c.text in ("happy", "sad") for c in choice.choices] == [True] * 3
    server.wait_until_drained()


def test_streamed_structured_completion_concatenates_to_a_valid_document(client, server):
    stream = client.completions.create(model=MODEL, prompt="Person:", max_tokens=400, temperature=1.0, seed=8,
                                       stream=True, extra_body={"structured_outputs": {"json": PERSON}})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)
    server.wait_until_drained()


def test_concurrent_structured_requests_each_follow_their_own_schema(server):
    schemas = [{"type": "object", "additionalProperties": False, "required": [f"k{i}"],
                "properties": {f"k{i}": {"type": "integer", "minimum": i, "maximum": i + 9}}} for i in range(8)]

    async def run() -> list[str]:
        client = server.async_client()
        responses = await asyncio.gather(*(
            client.completions.create(model=MODEL, prompt=f"n{i}", max_tokens=200, temperature=1.0, seed=i,
                                      extra_body={"structured_outputs": {"json": schema}})
            for i, schema in enumerate(schemas)))
        return [response.choices[0].text for response in responses]

    for schema, text in zip(schemas, asyncio.run(run()), strict=True):
        jsonschema.validate(json.loads(text), schema)
    server.wait_until_drained()


@pytest.mark.parametrize(
    ("structured_outputs", "named"),
    [
        ({"json": {"type": "array", "uniqueItems": True}}, "cannot be enforced: uniqueItems"),
        ({"regex": "(?<=a)b"}, "look-around"),
        ({"grammar": 'root ::= "a" undefined_rule'}, "undefined_rule"),
    ],
)
def test_bad_constraints_are_400s_naming_the_problem(client, server, structured_outputs, named):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5,
                                  extra_body={"structured_outputs": structured_outputs})
    assert named in error.value.message
    server.wait_until_drained()
