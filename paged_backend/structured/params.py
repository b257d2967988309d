"""What a request asks its output to match (vLLM's `StructuredOutputsParams` names): exactly one constraint."""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass
from typing import Any

from paged_backend.errors import InvalidRequest, not_unicode

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
# What a schema too deep for the checker's (or the grammar compiler's) recursion is told; a request error, never a 500.
TOO_DEEP = (
    "the schema is nested too deeply to check; flatten it, or move nested parts into $defs and refer to them with $ref"
)


@dataclass
class StructuredOutputsParams:
    """One constraint on the generated text.

    >>> StructuredOutputsParams(choice=["yes", "no"]).kind
    'choice'
    >>> StructuredOutputsParams(regex="a+", choice=["a"])
    Traceback (most recent call last):
    paged_backend.errors.InvalidRequest: give exactly one structured-output constraint (json, regex, choice, grammar, json_object), got regex, choice
    """

    json: dict[str, Any] | str | None = None  # a JSON schema, as an object or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequest(
                f"give exactly one structured-output constraint ({', '.join(CONSTRAINTS)}), got "
                f"{', '.join(given) or 'none'}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequest("structured-output choice must be a non-empty list of strings")
        for index, text in enumerate([self.regex] if isinstance(self.regex, str) else self.choice or []):
            if reason := not_unicode(text):  # the grammar engine's own words were about hex escapes
                where = "regex" if self.regex is not None else f"choice {index}"
                raise InvalidRequest(f"structured-output {where} is not valid Unicode ({reason}); send UTF-8 text")
        if isinstance(self.regex, str) and (len(self.regex) - len(self.regex.rstrip("\\"))) % 2:
            # llguidance takes a trailing lone backslash as nothing and generated an empty string
            raise InvalidRequest("structured-output regex ends in a lone backslash; escape it (\\\\) or remove it")

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    def cache_key(self) -> tuple:
        """Equal constraints share one compiled grammar."""
        value = getattr(self, self.kind)
        if isinstance(value, (dict, list)):
            value = json_module.dumps(value, sort_keys=True)
        return self.kind, value, self.disable_any_whitespace


def json_schema_error(schema: Any) -> tuple[str, str] | None:
    """Why `schema` is not a valid JSON schema of its own draft, as (jsonschema's sentence, where), or None.

    Every face checks schemas through this one function; the grammar engine still refuses what it cannot compile
    when jsonschema (the `structured` extra) is not installed.

    >>> json_schema_error({"type": "objekt"})[1]
    'type'
    >>> json_schema_error({"$schema": []})
    ("'$schema' must be a URI string", 'the top level')
    >>> deep = {}
    >>> for _ in range(2000): deep = {"type": "array", "items": deep}
    >>> json_schema_error(deep)[0] == TOO_DEEP
    True
    """
    if isinstance(schema, dict) and not isinstance(schema.get("$schema", ""), str):  # jsonschema looks it up by text
        return "'$schema' must be a URI string", "the top level"
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as error:
        return error.message, "/".join(map(str, error.absolute_path)) or "the top level"
    except RecursionError:  # jsonschema descends a frame or more per level: a deep schema runs out of stack
        return TOO_DEEP, "the top level"
    return None


def checked_json_schema(schema: Any) -> Any:
    """`schema` itself when it is None or a valid JSON schema, else a ValueError naming the problem: what every
    request model's schema field validates with."""
    problem = None if schema is None else json_schema_error(schema)
    if problem is not None:
        raise ValueError(problem[0] if problem[0] == TOO_DEEP else f"not a valid JSON schema: {problem[0]}")
    return schema
