"""The request fields that constrain output, mapped to one `StructuredOutputsParams` for the engine.

Accepted spellings, at most one per request: OpenAI's `response_format` (`text` means no constraint,
`json_object`, `json_schema` with `json_schema.schema`), vLLM's `structured_outputs` object
(json | regex | choice | grammar | json_object) and its older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. Both /v1/completions and /v1/chat/completions call `structured_outputs_params`.

>>> from types import SimpleNamespace
>>> structured_outputs_params(SimpleNamespace(guided_choice=["yes", "no"])).choice
['yes', 'no']
"""

from __future__ import annotations

import json
from typing import Any

from paged_backend.errors import InvalidRequest
from paged_backend.structured.params import TOO_DEEP, StructuredOutputsParams, json_schema_error

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs_params(body: Any) -> StructuredOutputsParams | None:
    """The one constraint `body` asks for, or None. Raises InvalidRequest naming the field when the request gives
    two constraints, or a JSON schema that is not one."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format.type != "text":
        found.append(("response_format", _from_response_format(response_format)))
    requested = getattr(body, "structured_outputs", None)
    if requested is not None:
        found.append(("structured_outputs", _from_structured_outputs(requested)))
    for field, kind in GUIDED_FIELDS.items():
        value = getattr(body, field, None)
        if value is not None:
            found.append((field, _params(field, **{kind: value})))
    if len(found) > 1:
        raise InvalidRequest(
            f"give one output constraint, not several: the request sets {', '.join(name for name, _ in found)}"
        )
    return found[0][1] if found else None


def _from_response_format(response_format: Any) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return _params("response_format", json_object=True)
    json_schema = response_format.json_schema
    if json_schema is None or json_schema.json_schema is None:
        raise InvalidRequest(
            'response_format {"type": "json_schema"} needs "json_schema": {"name": ..., "schema": {...}}'
        )
    return _params("response_format.json_schema.schema", json=json_schema.json_schema)


def _from_structured_outputs(requested: Any) -> StructuredOutputsParams:
    return _params(
        "structured_outputs", json=requested.json_, regex=requested.regex, choice=requested.choice,
        grammar=requested.grammar, json_object=requested.json_object or None,
        disable_any_whitespace=requested.disable_any_whitespace,
    )  # fmt: skip


def _params(field: str, **constraint: Any) -> StructuredOutputsParams:
    """StructuredOutputsParams with the field named in any error; a JSON schema is checked against its metaschema."""
    if constraint.get("json") is not None:
        constraint["json"] = checked_schema(field, constraint["json"])
    try:
        return StructuredOutputsParams(**constraint)
    except InvalidRequest as error:
        raise InvalidRequest(f"{field}: {error}") from None


def checked_schema(field: str, schema: Any) -> dict[str, Any]:
    """`schema` (an object or its JSON text) as an object checked against its metaschema; else InvalidRequest
    naming `field`."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise InvalidRequest(f"{field}: the JSON schema is not valid JSON ({error})") from None
        except RecursionError:
            raise InvalidRequest(f"{field}: {TOO_DEEP}") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{field}: a JSON schema must be an object, got {type(schema).__name__}")
    problem = json_schema_error(schema)
    if problem is not None and problem[0] == TOO_DEEP:
        raise InvalidRequest(f"{field}: {TOO_DEEP}")
    if problem is not None:
        raise InvalidRequest(f"{field} is not a valid JSON schema: {problem[0]}")
    return schema
