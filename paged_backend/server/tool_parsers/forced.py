"""tool_choice "required" or a named function: the JSON schema that structured outputs enforce, and its reader.

- named: the output is that function's arguments object, so the schema is the function's `parameters`.
- required: the output is a JSON array of `{"name": ..., "arguments": ...}` with at least one item; each item
  is one of the tools (`anyOf`, the name pinned by a one-value enum), so every call's arguments validate
  against its own function's parameters. `parallel_tool_calls=false` caps the array at one item.
"""

from __future__ import annotations

from typing import Any

from paged_backend.server.tool_parsers.mistral import JsonArrayToolParser
from paged_backend.server.tool_parsers.stream import ParsedToolCallStream

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def named_call_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's parameters schema; a function that declares none takes any object, as OpenAI reads it."""
    return parameters if parameters else ANY_OBJECT


def required_calls_schema(functions: dict[str, dict[str, Any] | None], parallel: bool) -> dict[str, Any]:
    """`functions`: name -> parameters schema (or None).

    >>> required_calls_schema({"f": None}, parallel=False)["maxItems"]
    1
    """
    one_call = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "arguments": named_call_schema(parameters)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in functions.items()
    ]
    items = one_call[0] if len(one_call) == 1 else {"anyOf": one_call}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class RequiredCallsParser(JsonArrayToolParser):
    """The constrained output of tool_choice="required": the array alone, no marker, no content."""

    name = "required"
    argument_keys = ("arguments",)


def required_calls_stream(parallel: bool) -> ParsedToolCallStream:
    return ParsedToolCallStream(RequiredCallsParser(), None if parallel else 1)
