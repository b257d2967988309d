"""Structured outputs end to end through the engine with a random-weight model: every output parses and validates.

A random model never chooses to close a string or an array; only the grammar can make it. So every schema here
bounds its strings and arrays (maxLength, maxItems, enums, patterns), objects forbid extra properties, numbers with
a fraction have a multipleOf where greedy decoding would otherwise write zeros forever ("0.0000..."), and
max_tokens is generous (the longest outputs are ~150 tokens): every output must then finish with "stop".
Free KV blocks return to the total after each test (the make_llm fixture checks it).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from _engine_helpers import make_llm_fixture  # noqa: F401

from paged_backend.engine import SamplingParams
from paged_backend.errors import InvalidRequest
from paged_backend.structured import StructuredOutputsParams

MAX_TOKENS = 400
NAME = {"type": "string", "maxLength": 6}

SCHEMAS: dict[str, dict] = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "additionalProperties": False, "required": ["user"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["id", "address"], "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                        "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}},
    "array_of_numbers": {"type": "array", "items": {"type": "number", "minimum": -10, "maximum": 10},
                         "minItems": 1, "maxItems": 4},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"enum": [1, "two", None, True]}},
             "required": ["color", "size"], "additionalProperties": False},
    "bounded_numbers": {"type": "object", "additionalProperties": False, "required": ["score", "ratio", "count"],
                        "properties": {"score": {"type": "integer", "minimum": -5, "maximum": 5},
                                       "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01},
                                       "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 50}}},
    "optional_fields": {"type": "object", "additionalProperties": False, "required": ["id"],
                        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "note": NAME,
                                       "done": {"type": "boolean"}}},
    "ref": {"$defs": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                                "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                               "y": {"type": "integer", "minimum": -99, "maximum": 99}}}},
            "type": "object", "additionalProperties": False, "required": ["start", "end"],
            "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}},
    "array_of_objects": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                       "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
    "any_of": {"type": "object", "additionalProperties": False, "required": ["value"],
               "properties": {"value": {"anyOf": [NAME, {"type": "integer", "minimum": 0, "maximum": 9},
                                                  {"type": "null"}]}}},
    "const_and_bool": {"type": "object", "additionalProperties": False, "required": ["kind", "ok"],
                       "properties": {"kind": {"const": "event"}, "ok": {"type": "boolean"}}},
    "string_formats": {"type": "object", "additionalProperties": False, "required": ["day", "code"],
                       "properties": {"day": {"type": "string", "format": "date"},
                                      "code": {"type": "string", "minLength": 2, "maxLength": 4}}},
    "tuple": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["a", "b"]}],
              "items": False},
    "top_level_enum": {"enum": ["alpha", "beta", 42]},
}
PROMPTS = ["Return JSON.", "The answer, as data:", "{", "x" * 30]


def check_document(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_every_schema_output_parses_and_validates_greedy_and_seeded(make_llm):
    llm = make_llm()
    requests = [(name, temperature) for name in SCHEMAS for temperature in (0.0, 1.0)]
    params = [SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]), temperature=temperature,
                             seed=None if temperature == 0 else 11, max_tokens=MAX_TOKENS) for name, temperature in requests]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(requests))]
    outputs = llm.generate(prompts, params)
    for (name, temperature), output in zip(requests, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (name, temperature, completion.text)
        check_document(completion.text, SCHEMAS[name])


def test_seeded_structured_output_is_reproducible_and_greedy_matches_alone(make_llm):
    llm = make_llm()
    schema = SCHEMAS["array_of_objects"]
    seeded = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), temperature=1.0, seed=5,
                            max_tokens=MAX_TOKENS)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)  # an unconstrained row in the same batch
    together = llm.generate(["abc", "abc", "plain"], [seeded, seeded, greedy])
    alone = llm.generate(["plain"], greedy)
    assert together[0].outputs[0].text == together[1].outputs[0].text
    check_document(together[0].outputs[0].text, schema)
    assert together[2].outputs[0].token_ids == alone[0].outputs[0].token_ids  # masks never touch other rows


def test_regex_choice_and_grammar_outputs_match(make_llm):
    llm = make_llm()
    cases = [
        (StructuredOutputsParams(regex=r"[A-Z]{3}-\d{2,4}"), lambda t: re.fullmatch(r"[A-Z]{3}-\d{2,4}", t)),
        (StructuredOutputsParams(regex=r"(yes|no|maybe)!"), lambda t: t in ("yes!", "no!", "maybe!")),
        (StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
         lambda t: t in ("positive", "negative", "neutral")),
        (StructuredOutputsParams(grammar='root ::= "(" d ("+" d){0,3} ")"\nd ::= [0-9]'),
         lambda t: re.fullmatch(r"\(\d(\+\d){0,3}\)", t)),
    ]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(structured_outputs=case, temperature=temperature, seed=3, max_tokens=MAX_TOKENS)
                  for case, _ in cases]
        outputs = llm.generate(["Pick one:"] * len(cases), params)
        for (case, matches), output in zip(cases, outputs, strict=True):
            assert output.outputs[0].finish_reason == "stop"
            assert matches(output.outputs[0].text), (case, output.outputs[0].text)


def test_n_siblings_each_follow_the_grammar_from_the_start(make_llm):
    llm = make_llm()
    schema = SCHEMAS["nested"]
    params = SamplingParams(n=4, temperature=1.2, seed=9, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(json=schema))
    [output] = llm.generate(["Siblings:"], params)
    assert len(output.outputs) == 4
    for completion in output.outputs:
        check_document(completion.text, schema)
    assert len({completion.text for completion in output.outputs}) > 1  # seeded siblings sample differently


def test_preempted_requests_resume_their_grammar(make_llm):
    llm = make_llm(num_blocks=40, block_size=4)  # 39 usable blocks of 4 tokens for 6 sequences of ~50 tokens
    schema = SCHEMAS["ref"]
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    outputs = llm.generate([f"request {i}" for i in range(6)], params)
    assert llm.engine.scheduler.num_preemptions > 0
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop"
        check_document(output.outputs[0].text, schema)


def test_stop_string_cuts_a_structured_output(make_llm):
    llm = make_llm()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"[a-c]{3}-[a-c]{3}"), stop=["-"],
                            temperature=1.0, seed=4, max_tokens=MAX_TOKENS)
    [output] = llm.generate(["stop here"], params)
    completion = output.outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "-")
    assert re.fullmatch(r"[a-c]{3}", completion.text)


def test_chunked_prefill_then_structured_decode(make_llm):
    llm = make_llm(enable_chunked_prefill=True, max_num_batched_tokens=16)
    names = ["flat", "enum", "bounded_numbers"]
    params = [SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMAS[name], disable_any_whitespace=True),
                             temperature=1.0, seed=i, max_tokens=MAX_TOKENS) for i, name in enumerate(names)]
    outputs = llm.generate(["long prompt " * 10] * len(names), params)
    for name, output in zip(names, outputs, strict=True):
        text = output.outputs[0].text
        check_document(text, SCHEMAS[name])
        assert " " not in text.replace("long prompt", "")  # disable_any_whitespace: compact separators


def test_min_tokens_does_not_break_a_finished_grammar(make_llm):
    llm = make_llm()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["ok", "no"]), min_tokens=8,
                            temperature=1.0, seed=1, max_tokens=MAX_TOKENS)
    [output] = llm.generate(["min"], params)
    assert output.outputs[0].text in ("ok", "no")


def test_a_grammar_engine_failure_mid_output_ends_the_sequence_and_is_logged(make_llm, caplog):
    """llguidance builds a huge repetition lazily and gives up at the first 'a': the sequence ends there, in the log."""
    llm = make_llm()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a{10000000}"), temperature=0,
                            max_tokens=MAX_TOKENS)  # fmt: skip
    with caplog.at_level("WARNING", logger="paged_backend.engine.output_processor"):
        [output] = llm.generate(["x"], params)
    assert len(output.outputs[0].token_ids) < MAX_TOKENS
    assert "structured-output constraint failed at output token 1" in caplog.text
    assert not llm.engine.has_unfinished_requests()


def test_bad_constraint_is_refused_before_queueing(make_llm):
    llm = make_llm()
    with pytest.raises(InvalidRequest, match="uses keywords that cannot be enforced: not"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(json={"not": {}})))
    assert not llm.engine.has_unfinished_requests()
