"""The structured-output request fields: each spelling maps to one StructuredOutputsParams, and on /v1/completions
the output obeys it (random weights, so only the grammar makes the text valid).

The mapping tests run anywhere; the server tests need the grammar engine (paged_backend/structured/manager.py).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from paged_backend.errors import InvalidRequest
from paged_backend.server.schemas import CompletionRequest
from paged_backend.server.structured_fields import structured_outputs_params
from tests._server_helpers import MODEL, server_fixture

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def mapped(**fields):
    return structured_outputs_params(CompletionRequest.model_validate({"prompt": "x", **fields}))


SPELLINGS = {
    "response_format json_schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}},
        ("json", SCHEMA),
    ),
    "response_format json_object": ({"response_format": {"type": "json_object"}}, ("json_object", True)),
    "guided_json object": ({"guided_json": SCHEMA}, ("json", SCHEMA)),
    "guided_json text": ({"guided_json": json.dumps(SCHEMA)}, ("json", SCHEMA)),
    "guided_regex": ({"guided_regex": "[a-c]{3}"}, ("regex", "[a-c]{3}")),
    "guided_choice": ({"guided_choice": ["yes", "no"]}, ("choice", ["yes", "no"])),
    "guided_grammar": ({"guided_grammar": 'root ::= "a"'}, ("grammar", 'root ::= "a"')),
    "structured_outputs json": ({"structured_outputs": {"json": SCHEMA}}, ("json", SCHEMA)),
    "structured_outputs regex": ({"structured_outputs": {"regex": "x+"}}, ("regex", "x+")),
    "structured_outputs choice": ({"structured_outputs": {"choice": ["a"]}}, ("choice", ["a"])),
    "structured_outputs grammar": ({"structured_outputs": {"grammar": "g"}}, ("grammar", "g")),
    "structured_outputs json_object": ({"structured_outputs": {"json_object": True}}, ("json_object", True)),
}


@pytest.mark.parametrize(("fields", "expected"), SPELLINGS.values(), ids=SPELLINGS.keys())
def test_every_spelling_maps_to_one_constraint(fields, expected):
    params = mapped(**fields)
    assert (params.kind, getattr(params, params.kind)) == expected


def test_text_format_and_a_bare_backend_choice_constrain_nothing():
    assert mapped(response_format={"type": "text"}, guided_decoding_backend="xgrammar") is None
    assert mapped() is None


REFUSED = {
    "two spellings at once": ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    "two constraints in one object": ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    "not a JSON schema": ({"guided_json": {"type": "nonsense"}}, "guided_json is not a valid JSON schema"),
    "schema text that is not JSON": ({"guided_json": "{not json"}, "not valid JSON"),
    "non-string $schema": ({"guided_json": {"$schema": 5}}, "$schema"),
    "json_schema without its schema": ({"response_format": {"type": "json_schema"}}, '"schema"'),
}


@pytest.mark.parametrize(("fields", "message"), REFUSED.values(), ids=REFUSED.keys())
def test_ambiguous_or_broken_constraints_are_refused_by_name(fields, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        mapped(**fields)


server = server_fixture("--num-blocks", "256", "--max-model-len", "256")


def complete(server, **fields):
    response = server.post("/v1/completions", json={"model": MODEL, "prompt": "Output:", "max_tokens": 64,
                                                    "seed": 0, **fields})  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_completions_json_schema_output_validates(server):
    fields = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
    choice = complete(server, **fields)
    jsonschema.validate(json.loads(choice["text"]), SCHEMA)


def test_completions_regex_and_choice_outputs_match(server):
    assert re.fullmatch(r"[a-c]{3}", complete(server, guided_regex="[a-c]{3}")["text"])
    assert complete(server, structured_outputs={"choice": ["red", "green"]})["text"] in ("red", "green")
    assert isinstance(json.loads(complete(server, response_format={"type": "json_object"})["text"]), dict)


def test_a_constraint_the_engine_cannot_compile_is_a_400(server):
    response = server.post("/v1/completions", json={"prompt": "x", "guided_regex": "(unclosed"})
    assert response.status_code == 400, response.text
    server.wait_until_drained()
