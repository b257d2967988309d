"""Tool-call parsers on scripted model outputs: whole, streamed piece by piece, and malformed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from paged_backend.errors import InvalidRequest
from paged_backend.server.tool_parsers import (
    NamedToolCallStream,
    ParsedToolCallStream,
    get_tool_parser,
    named_call_schema,
    required_calls_schema,
    required_calls_stream,
)
from paged_backend.server.tool_parsers.base import partial_marker_length

WEATHER = '{"city": "Paris", "days": [1, 2], "note": "a } and a \\" inside"}'
SCRIPTS = {
    "hermes": (
        f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
        '<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>',
        "Let me check.\n",
    ),
    "llama3_json": (f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "get_time"}}', None),
    "mistral": (
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "get_time", "arguments": {{}}}}]',
        None,
    ),
}
EXPECTED_CALLS = [("get_weather", WEATHER), ("get_time", "{}")]


def streamed(stream, text: str, piece: int) -> tuple[str, list[tuple[str, str, str]]]:
    """Feed `text` `piece` characters at a time; reassemble content and calls as an OpenAI client does."""
    deltas = [stream.feed(text[i : i + piece]) for i in range(0, max(len(text), 1), piece)] + [stream.finish()]
    content, calls = "", {}
    for delta in deltas:
        content += delta.content
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index == len(calls) and call.name, "a call's first delta carries its id and name"
                calls[call.index] = [call.id, call.name, ""]
            calls[call.index][2] += call.arguments
    return content, [tuple(calls[index]) for index in sorted(calls)]


@pytest.mark.parametrize("parser_name", SCRIPTS)
def test_whole_output_yields_content_and_calls(parser_name):
    text, content = SCRIPTS[parser_name]
    extracted = get_tool_parser(parser_name).extract(text)
    assert extracted.content == content
    assert [(call.name, call.arguments) for call in extracted.tool_calls] == EXPECTED_CALLS
    assert all(call.id.startswith("chatcmpl-tool-") for call in extracted.tool_calls)
    assert json.loads(extracted.tool_calls[0].arguments)["note"] == 'a } and a " inside'


@pytest.mark.parametrize("piece", [1, 3, 7])
@pytest.mark.parametrize("parser_name", SCRIPTS)
def test_streamed_output_reassembles_to_the_whole_answer(parser_name, piece):
    text, content = SCRIPTS[parser_name]
    streamed_content, calls = streamed(ParsedToolCallStream(get_tool_parser(parser_name)), text, piece)
    assert streamed_content == (content or "")
    assert [(name, arguments) for _, name, arguments in calls] == EXPECTED_CALLS
    assert len({call_id for call_id, _, _ in calls}) == 2


def test_hermes_never_streams_a_partial_marker_as_content():
    stream = ParsedToolCallStream(get_tool_parser("hermes"))
    sent = "".join(stream.feed(char).content for char in "Hi <tool_c")
    assert sent == "Hi "
    assert stream.finish().content == "<tool_c"  # it never became a call: the rest is content after all


@pytest.mark.parametrize(
    "parser_name, text",
    [
        ("hermes", "Plain answer, no calls."),
        ("hermes", "<tool_call>not json</tool_call>"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        ("llama3_json", "The weather is nice."),
        ("llama3_json", '{"city": "Paris"}'),  # JSON, but not a call
        ("mistral", "[TOOL_CALLS] get_weather"),
        ("mistral", "[TOOL_CALLS] [oops]"),
    ],
)
@pytest.mark.parametrize("piece", [1, 4])
def test_text_that_is_not_well_formed_calls_is_content_whole_and_streamed(parser_name, text, piece):
    extracted = get_tool_parser(parser_name).extract(text)
    assert (extracted.content, extracted.tool_calls) == (text, [])
    assert streamed(ParsedToolCallStream(get_tool_parser(parser_name)), text, piece) == (text, [])


@pytest.mark.parametrize(
    "parser_name, text",
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}'),  # cut off inside the call
        ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": 1}} and then words'),
        ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}'),  # array never closed
    ],
)
def test_a_call_broken_after_its_name_is_a_call_whole_and_streamed_but_not_complete(parser_name, text):
    """A stream cannot take back a call it has begun (neither can vLLM's), so the whole answer reports it too:
    both agree that a call was made, and both say it is not complete (chat then keeps finish_reason "length")."""
    assert get_tool_parser(parser_name).extract(text).tool_calls == []  # the parser alone reads only whole calls
    whole = ParsedToolCallStream(get_tool_parser(parser_name)).extract(text)
    assert [(call.name, call.arguments) for call in whole.tool_calls] == [("f", '{"x": 1}')]
    assert whole.content is None and not whole.complete
    stream = ParsedToolCallStream(get_tool_parser(parser_name))
    content, calls = streamed(stream, text, 2)
    assert content == "" and [(name, arguments) for _, name, arguments in calls] == [("f", '{"x": 1}')]
    assert stream.called and not stream.complete


CUT_SCRIPTS = {
    **{name: (text, lambda name=name: ParsedToolCallStream(get_tool_parser(name))) for name, (text, _) in
       SCRIPTS.items()},
    "required": (json.dumps([{"name": "get_weather", "arguments": {"city": "Rome", "days": [1, 2]}},
                             {"name": "get_time", "arguments": {}}]), lambda: required_calls_stream(parallel=True)),
    "required, one call": (json.dumps([{"name": "get_weather", "arguments": {"city": "Rome"}}]),
                           lambda: required_calls_stream(parallel=False)),
    "named": ('{"city": "Rome", "days": [1, 2]}', lambda: NamedToolCallStream("get_weather")),
}  # fmt: skip


@pytest.mark.parametrize("piece", [1, 5])
@pytest.mark.parametrize("script", CUT_SCRIPTS)
def test_an_output_cut_anywhere_reads_the_same_whole_and_streamed(script, piece):
    """max_tokens may cut an output at any character: the whole answer then says what the stream said (the same
    content, the same calls with the same arguments so far), and both say whether the calls are complete."""
    text, reader = CUT_SCRIPTS[script]
    for end in range(len(text) + 1):
        cut = text[:end]
        whole = reader().extract(cut)
        stream = reader()
        content, calls = streamed(stream, cut, piece)
        assert (whole.content or "", [(c.name, c.arguments) for c in whole.tool_calls]) == (
            content, [(name, arguments) for _, name, arguments in calls]), cut
        assert whole.complete == stream.complete, cut
        if whole.complete:  # complete means whole calls only: their arguments are JSON
            assert all(json.loads(call.arguments) is not None for call in whole.tool_calls), cut
    assert whole.complete and whole.tool_calls


def test_whitespace_before_a_call_is_not_content():
    text = '\n\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert get_tool_parser("hermes").extract(text).content is None
    assert streamed(ParsedToolCallStream(get_tool_parser("hermes")), text, 1)[0] == ""


def test_arguments_written_as_a_json_string_are_passed_through():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    [call] = get_tool_parser("hermes").extract(text).tool_calls
    assert json.loads(call.arguments) == {"x": 1}
    assert streamed(ParsedToolCallStream(get_tool_parser("hermes")), text, 2)[1][0][1:] == ("f", '{"x": 1}')


def test_parallel_tool_calls_false_keeps_only_the_first_call():
    text, _ = SCRIPTS["hermes"]
    stream = ParsedToolCallStream(get_tool_parser("hermes"), max_calls=1)
    assert [call.name for call in stream.extract(text).tool_calls] == ["get_weather"]
    assert [name for _, name, _ in streamed(stream, text, 5)[1]] == ["get_weather"]


def test_unknown_parser_names_the_choices():
    with pytest.raises(InvalidRequest, match="hermes, llama3_json, mistral"):
        get_tool_parser("xml")


def test_partial_marker_length_counts_only_a_real_prefix():
    assert partial_marker_length("abc <", "<tool_call>") == 1
    assert partial_marker_length("abc", "<tool_call>") == 0
    assert partial_marker_length("<tool_call", "<tool_call>") == 10


PARAMETERS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city"],
    },
    "get_time": None,
}


def test_required_schema_accepts_calls_to_the_tools_and_nothing_else():
    schema = required_calls_schema(PARAMETERS, parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {"days": 2}}], [{"name": "nope", "arguments": {}}],
                [{"name": "get_weather", "arguments": {"city": "Rome", "days": 0}}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, required_calls_schema(PARAMETERS, parallel=False))


@pytest.mark.parametrize("piece", [1, 6])
def test_required_output_reads_back_as_calls(piece):
    calls = [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]
    text = json.dumps(calls)
    extracted = required_calls_stream(parallel=True).extract(text)
    assert extracted.content is None
    assert [(call.name, json.loads(call.arguments)) for call in extracted.tool_calls] == [
        ("get_weather", {"city": "Rome"}), ("get_time", {})]  # fmt: skip
    _, streamed_calls = streamed(required_calls_stream(parallel=True), text, piece)
    assert [(name, json.loads(arguments)) for _, name, arguments in streamed_calls] == [
        ("get_weather", {"city": "Rome"}), ("get_time", {})]  # fmt: skip


def test_named_choice_streams_the_whole_output_as_arguments():
    assert named_call_schema(PARAMETERS["get_weather"]) is PARAMETERS["get_weather"]
    assert named_call_schema(None) == {"type": "object"}
    text = '{"city": "Oslo"}'
    assert streamed(NamedToolCallStream("get_weather"), text, 3)[1][0][1:] == ("get_weather", text)
    [call] = NamedToolCallStream("get_weather").extract(text).tool_calls
    assert (call.name, call.arguments) == ("get_weather", text)
