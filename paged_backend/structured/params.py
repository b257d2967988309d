"""What a request asks its output to match (vLLM's `StructuredOutputsParams` names): exactly one constraint."""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass
from typing import Any

from paged_backend.errors import InvalidRequest

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


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

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    def cache_key(self) -> tuple:
        """Equal constraints share one compiled grammar."""
        value = getattr(self, self.kind)
        if isinstance(value, (dict, list)):
            value = json_module.dumps(value, sort_keys=True)
        return self.kind, value, self.disable_any_whitespace
