"""A schemathesis check, loaded through SCHEMATHESIS_HOOKS by tests/test_openapi_conformance.py.

POST routes may refuse schema-valid data with a 400 for rules a JSON schema cannot state (see that test). This
check keeps that allowance honest: such a 400 must come from one of those rules, never from the body's own type
and range validation, which the document describes; pydantic's wording for a type or range miss means the
document and the server disagree.
"""

from __future__ import annotations

import re

import schemathesis

# Messages the server writes for failures of the body's declared types and ranges (openai_errors.py).
SCHEMA_LEVEL_REJECTION = re.compile(
    r"^invalid value for '[^']*': (Input should|String should|List should|Dictionary should|Object should"
    r"|Value should|it fits none of the accepted forms|it is an empty string|it must be a finite number"
    r"|it must be a whole number|it must be an integer of at most 64 bits)|^'[^']*' is required$"
)


@schemathesis.check
def schema_valid_bodies_pass_schema_validation(ctx, response, case):
    """A schema-valid body refused for a reason the schema states (or should state) is a disagreement."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 400:
        return None
    message = response.json().get("error", {}).get("message", "")
    if SCHEMA_LEVEL_REJECTION.search(message):
        raise AssertionError(f"a schema-valid body was refused by the body's own validation: {message}")
    return None
