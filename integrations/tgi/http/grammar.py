"""TGI's `grammar` parameter: validation into the protocol's (type, text) pair, and the engine's constraint.

TGI carries a grammar as `NextTokenChooserParameters.grammar` (text) plus `grammar_type` (json | regex), so every
backend receives the same normalized form: a JSON schema serialized to text, or a regular expression.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from paged_backend.errors import InvalidRequest
from paged_backend.structured.params import StructuredOutputsParams, json_schema_error
from paged_backend.tgi.http.errors import ValidationError

GrammarType = Literal["json", "regex"]
ANY_OBJECT_SCHEMA = {"type": "object"}


@dataclass(frozen=True)
class ValidGrammar:
    type: GrammarType
    text: str  # a JSON schema's text or a regular expression

    def structured_outputs(self) -> StructuredOutputsParams:
        """The engine's constraint for this grammar; JSON comes compact (TGI's grammars allow no free whitespace
        either), so a model cannot spend its token budget on indentation."""
        if self.type == "json":
            return StructuredOutputsParams(json=self.text, disable_any_whitespace=True)
        return StructuredOutputsParams(regex=self.text)


def _invalid(problem: str) -> ValidationError:
    return ValidationError(f"grammar is not valid: {problem}")


def _schema(value: Any, *, empty_means_any_object: bool) -> dict:
    """A JSON schema given as an object or as its JSON text."""
    if value is None or value == "" or value == {}:
        if empty_means_any_object:
            return dict(ANY_OBJECT_SCHEMA)
        raise _invalid("a json grammar needs a JSON schema as its `value`")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise _invalid(f"`value` is not JSON: {error}") from error
    if not isinstance(value, dict):
        raise _invalid(f"a JSON schema must be an object, got {type(value).__name__}")
    problem = json_schema_error(value)  # meta-validated against the schema's own draft
    if problem is not None:
        message, where = problem
        raise _invalid(f"{message} (at {where})")
    return value


def validate_grammar(grammar_type: str, value: Any) -> ValidGrammar:
    """TGI's grammar forms: json / json_object (schema or its text), json_schema ({name?, schema}), regex (str)."""
    if grammar_type == "regex":
        if not isinstance(value, str) or not value:
            raise _invalid("a regex grammar needs a non-empty string `value`")
        return ValidGrammar("regex", value)
    if grammar_type == "json_schema":
        if not isinstance(value, dict):
            raise _invalid('a json_schema grammar needs a `value` of the form {"name": ..., "schema": {...}}')
        value = value.get("schema")  # no schema: any JSON object, as OpenAI's json_schema without one
    schema = _schema(value, empty_means_any_object=grammar_type in ("json_object", "json_schema"))
    return ValidGrammar("json", json.dumps(schema))


def response_format_grammar(response_format) -> ValidGrammar | None:
    """OpenAI's `response_format` (text | json_object | json_schema with `json_schema`) or TGI's (`type`, `value`)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_schema" and response_format.json_schema is not None:
        return validate_grammar("json_schema", response_format.json_schema)
    return validate_grammar(response_format.type, response_format.value)


class GrammarCompiler:
    """Compiles grammars where no engine runs (the gRPC router), so a bad one is a 422 before it reaches a batch.

    The shard compiles again for its own vocabulary; the engine caches compiled grammars by content either way.
    """

    def __init__(self, tokenizer, eos_token_ids: set[int]) -> None:
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self._manager = None

    def check(self, grammar: ValidGrammar) -> None:
        try:
            if self._manager is None:
                from paged_backend.structured.manager import StructuredOutputManager

                self._manager = StructuredOutputManager(
                    self.tokenizer, vocab_size=len(self.tokenizer), eos_token_ids=self.eos_token_ids
                )
            self._manager.validate(grammar.structured_outputs())
        except InvalidRequest as error:
            raise _invalid(str(error)) from error
        except ImportError as error:
            raise ValidationError(f"grammar is not supported: {error}") from error
