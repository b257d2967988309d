"""TGI grammar and tool plumbing without a server: the accepted forms, the v3 protocol round trip, tool grammars."""

from __future__ import annotations

import json

import jsonschema
import pytest

from paged_backend.tgi.http.errors import ToolError, ValidationError
from paged_backend.tgi.http.grammar import ValidGrammar, response_format_grammar, validate_grammar
from paged_backend.tgi.http.schemas import ResponseFormat
from paged_backend.tgi.http.tools import NO_TOOL, parse_reply, plan_tools
from paged_backend.tgi.http.validation import ChooserParameters, StoppingParameters, ValidRequest
from paged_backend.tgi.router.queue import Entry, request_pb
from paged_backend.tgi.shard.batch import chooser_from_pb

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"key": {"$ref": "#/$defs/Key"}},
            "required": ["key"],
            "$defs": {"Key": {"type": "string", "enum": ["x", "y"]}},
        },
    },
}


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        ("json", SCHEMA),
        ("json", json.dumps(SCHEMA)),
        ("json_object", SCHEMA),
        ("json_schema", {"name": "thing", "schema": SCHEMA}),
    ],
)
def test_every_json_form_normalizes_to_the_schema_text(kind, value):
    grammar = validate_grammar(kind, value)
    assert grammar.type == "json" and json.loads(grammar.text) == SCHEMA
    assert json.loads(grammar.structured_outputs().json) == SCHEMA


def test_empty_json_object_and_regex_forms():
    assert json.loads(validate_grammar("json_object", None).text) == {"type": "object"}
    assert validate_grammar("regex", "[a-z]+").structured_outputs().regex == "[a-z]+"
    with pytest.raises(ValidationError, match="a json grammar needs a JSON schema"):
        validate_grammar("json", None)


def test_response_format_openai_and_tgi_shapes():
    openai = ResponseFormat(type="json_schema", json_schema={"name": "t", "schema": SCHEMA})
    assert json.loads(response_format_grammar(openai).text) == SCHEMA
    assert response_format_grammar(ResponseFormat(type="text")) is None
    assert response_format_grammar(ResponseFormat(type="regex", value="ab")).text == "ab"


@pytest.mark.parametrize("grammar", [ValidGrammar("json", json.dumps(SCHEMA)), ValidGrammar("regex", "a|b"), None])
def test_grammar_survives_the_v3_protocol(grammar):
    chooser = ChooserParameters(do_sample=True, typical_p=0.5, watermark=True, seed=3, grammar=grammar)
    request = ValidRequest("hi", [104, 105], chooser, StoppingParameters(max_new_tokens=4), decoder_input_details=True)
    message = request_pb(Entry(7, request), blocks=[1], slots=[16, 17, 18, 19, 20])
    assert message.prefill_logprobs
    back = chooser_from_pb(message.parameters)
    assert (back.grammar, back.watermark, back.do_sample) == (grammar, True, True)
    assert back.typical_p == pytest.approx(0.5)


def test_required_tools_grammar_accepts_only_calls_that_validate():
    plan = plan_tools([TOOL], "required")
    schema = json.loads(plan.grammar.text)
    call = {"function": {"_name": "lookup", "key": "x"}}
    jsonschema.validate(call, schema)  # the lifted $defs resolve from the grammar's root
    for wrong in ({"function": {"_name": "lookup", "key": "z"}}, {"function": {"_name": "other", "key": "x"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    reply = parse_reply(json.dumps(call))
    assert reply.content is None
    assert reply.tool_calls[0]["function"] == {"name": "lookup", "arguments": '{"key": "x"}', "description": None}


def test_auto_offers_a_plain_answer_and_none_offers_nothing():
    plan = plan_tools([TOOL], "auto")
    assert [function["name"] for function in plan.functions] == ["lookup", NO_TOOL]
    answer = {"function": {"_name": NO_TOOL, "content": "hello"}}
    jsonschema.validate(answer, json.loads(plan.grammar.text))
    assert parse_reply(json.dumps(answer)).content == "hello"
    assert plan_tools([TOOL], "none") is None
    assert parse_reply('{"function": {"_name": "lookup", "ke').content.startswith("{")  # cut short: text as is


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        ([TOOL], {"type": "function", "function": {"name": "missing"}}, "Tool with name missing not found"),
        ([{"type": "function", "function": {}}], "auto", "tools\\[0\\].function.name must be a non-empty string"),
        ([TOOL, TOOL], "auto", "tool names must be unique; repeated: lookup"),
        (None, "required", "tool_choice needs `tools`"),
        ([TOOL], 3, "tool_choice must be"),
    ],
)
def test_bad_tools_are_tool_errors(tools, choice, message):
    with pytest.raises(ToolError, match=message):
        plan_tools(tools, choice)
