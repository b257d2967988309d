"""A `StructuredOutputsParams` as an llguidance grammar, with every user mistake turned into an `InvalidRequest`.

>>> llguidance_grammar(StructuredOutputsParams(choice=["yes", "no"]))
'start: "yes" | "no"'
>>> llguidance_grammar(StructuredOutputsParams(regex="(?=a)b"))
Traceback (most recent call last):
paged_backend.errors.InvalidRequest: structured-output regex cannot be used: look-around, including look-ahead and look-behind, is not supported
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from paged_backend.errors import InvalidRequest
from paged_backend.structured.params import TOO_DEEP, StructuredOutputsParams, json_schema_error

# Whitespace a JSON gap may hold: one optional line break and indentation up to 20 columns. Bounded so a model
# (random weights, or just unlucky sampling) cannot loop on whitespace forever; it still covers pretty-printing.
JSON_WHITESPACE = r"(\r?\n)?[\x20\x09]{0,20}"
FLEXIBLE_JSON = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}  # disable_any_whitespace

LABELS = {"json": "json schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
          "grammar": "grammar"}


def llguidance_grammar(params: StructuredOutputsParams) -> str:
    """The grammar text an `llguidance.LLMatcher` takes; raises `InvalidRequest` naming what is wrong."""
    label = LABELS[params.kind]
    whitespace = COMPACT_JSON if params.disable_any_whitespace else FLEXIBLE_JSON
    try:
        if params.kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(_schema(params.json)),
                                                                    defaults=whitespace)
        elif params.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=whitespace)
        elif params.kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(params.regex)
        elif params.kind == "choice":
            # Lark string literals read JSON string escapes, so json.dumps quotes any choice exactly.
            grammar = llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(choice) for choice in params.choice))
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(any_to_lark(params.grammar))
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except InvalidRequest:
        raise
    except RecursionError as error:  # json.dumps of a schema deeper than the interpreter's stack
        raise InvalidRequest(f"structured-output {label} cannot be used: {TOO_DEEP}") from error
    except BaseException as error:  # pyo3 panics derive from BaseException; a backend failure is still the input's
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        reason = _one_line(str(error))
        if "recursion limit exceeded" in reason:  # llguidance reads JSON 128 levels deep at most
            reason = TOO_DEEP
        raise InvalidRequest(f"structured-output {label} cannot be used: {reason}") from error
    if is_error:
        unsupported = re.match(r"Unimplemented keys: \[(.*)\]", messages[0])
        if unsupported:
            keys = unsupported.group(1).replace('"', "")
            raise InvalidRequest(f"structured-output {label} uses keywords that cannot be enforced: {keys}; remove them")
        raise InvalidRequest(f"structured-output {label} cannot be used: {_one_line(messages[0])}")
    return grammar


def _schema(value: dict[str, Any] | str) -> dict[str, Any] | bool:
    """The schema as an object, checked against its metaschema so a malformed one gets jsonschema's sentence."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise InvalidRequest(f"structured-output json schema is not valid JSON: {error}") from error
        except RecursionError as error:
            raise InvalidRequest(f"structured-output json schema cannot be used: {TOO_DEEP}") from error
    if not isinstance(value, (dict, bool)):
        raise InvalidRequest(f"structured-output json schema must be a JSON object, got {type(value).__name__}")
    problem = json_schema_error(value)
    if problem is not None:
        message, where = problem
        raise InvalidRequest(f"structured-output json schema is malformed at {where}: {message}")
    return value


def _one_line(message: str) -> str:
    """llguidance's errors quote the source over several lines; keep the line that says what is wrong."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    said = next((line[len("error:"):].strip() for line in lines if line.startswith("error:")), None)
    return re.sub(r"\s+", " ", said or (lines[0] if lines else "the grammar engine refused it"))
