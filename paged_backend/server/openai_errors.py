"""Error bodies and the exception handlers that turn every failure into one (4xx for bad input).

Failures come in OpenAI's shape, except under /v1/messages, where Anthropic's clients expect Anthropic's
(`{"type": "error", "error": {"type", "message"}}`). An error that says when to come back (an integer
`retry_after`, in seconds) gets a `Retry-After` header.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.routing import compile_path

from paged_backend.engine.async_engine import EngineNotRunning, EngineStepFailed, RequestAborted
from paged_backend.engine.disconnect import ClientDisconnected
from paged_backend.errors import (
    InvalidRequest,
    OutOfBlocks,
    PagedBackendError,
    PromptTooLong,
    body_media_type_error,
    not_unicode,
)
from paged_backend.server.schemas import FIELDS_RULE_ERROR, UNKNOWN_FIELDS_ERROR

logger = logging.getLogger(__name__)

HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"})

ANTHROPIC_PREFIX = "/v1/messages"  # Anthropic's Messages API: its routes answer in Anthropic's error shape
# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
    529: "overloaded_error",
}  # fmt: skip


class ModelNotFound(Exception):
    """The request names a model this server does not serve."""


class AsciiJSONResponse(JSONResponse):
    """JSON escaped to ASCII: a body may quote request text (a model name in an error, stored metadata) holding a lone
    surrogate, which UTF-8 cannot carry (it would turn a 4xx into a 500)."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """The `{"error": {message, type, param, code}}` object every OpenAI endpoint returns on failure."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status_code: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return AsciiJSONResponse(error_body(message, type_, param, code), status_code=status_code)


def error_bytes(message: str, type_: str, code: str | None = None) -> bytes:
    """The same body, pre-serialized for the raw ASGI guard that answers before FastAPI runs."""
    return json.dumps(error_body(message, type_, None, code)).encode()


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(f"{ANTHROPIC_PREFIX}/")


def anthropic_error_body(message: str, status_code: int) -> dict:
    """Anthropic's error object for a failure answered with `status_code`."""
    type_ = ANTHROPIC_ERROR_TYPES.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": type_, "message": message}}


def retry_after_headers(error: BaseException) -> dict[str, str]:
    """`Retry-After` for an error that carries an integer `retry_after` (seconds), e.g. an engine asleep."""
    seconds = getattr(error, "retry_after", None)
    if isinstance(seconds, int) and not isinstance(seconds, bool):
        return {"Retry-After": str(max(seconds, 0))}
    return {}


def engine_error(error: Exception) -> tuple[int, dict]:
    """Status and body for an error raised by the engine or the async loop."""
    if isinstance(error, PromptTooLong):
        return 400, error_body(str(error), "invalid_request_error", "prompt", "context_length_exceeded")
    if isinstance(error, OutOfBlocks):
        return 429, error_body(str(error), "rate_limit_error", None, "kv_cache_full")
    if isinstance(error, (EngineNotRunning, RequestAborted)):
        return 503, error_body(str(error), "server_unavailable", None, "service_unavailable")
    if isinstance(error, EngineStepFailed):
        return 500, error_body(str(error), "internal_error", None, "engine_step_failed")
    if isinstance(error, (InvalidRequest, PagedBackendError)):
        return 400, error_body(str(error), "invalid_request_error", None, None)
    return 500, error_body("internal server error", "internal_error", None, None)


def describe_validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """A sentence naming the offending field, and that field's dotted path (OpenAI's `param`).

    A value that fits none of a union's forms yields one error per form, their locations sharing the field's
    path and then naming the form; those are reported once, at the field. When the value has the type of exactly
    one form ("" where a non-empty string or a list is accepted: only a constraint fails), or entered exactly one
    (a list where a string or a list is accepted), that form's own error is the one reported.
    """
    first = errors[0]
    kind = first.get("type", "")
    if kind in (UNKNOWN_FIELDS_ERROR, FIELDS_RULE_ERROR):  # the body's model names the field
        return first.get("msg", "unknown field"), first.get("ctx", {}).get("param")
    if kind == "json_invalid":
        where = _body_path(first)  # FastAPI puts the parser's character position there
        at = f" at position {where[0]}" if where and isinstance(where[0], int) else ""
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}{at}", None
    location = _field_path(first)
    if _is_union_member(_body_path(first)):  # the body is one of several models (POST /tokenize) and fits none
        if all(error.get("type") == "missing" for error in errors):
            missing = dict.fromkeys(_dotted(_field_path(error)) for error in errors)
            return f"the body needs {' or '.join(repr(name) for name in missing)}", None
        errors = _errors_of_the_closest_form(errors)
        first, kind, location = errors[0], errors[0].get("type", ""), _field_path(errors[0])
    if not location:
        return f"the request body is invalid: {first.get('msg')}", None
    siblings = [_field_path(error) for error in errors if _field_path(error)[:1] == location[:1]]
    common = _common_prefix(siblings)
    forms_differ = len(siblings) > 1 and len(common) < len(location) and _is_form_name(location[len(common)])
    if forms_differ:  # one value, several union forms (list indices are items, model fields are fields, not forms)
        depth = len(common)
        sized = [e for e in errors if e.get("type") in ("too_long", "too_short") and len(_field_path(e)) == depth + 1]
        if sized:  # a list of the right kind but the wrong length: its length is what to change
            return f"invalid value for '{_dotted(common)}': {sized[0].get('msg')}", _dotted(common)
        by_form: dict[Any, list[dict]] = {}
        for error in errors:
            if (path := _field_path(error))[:depth] == common and len(path) > depth:
                by_form.setdefault(path[depth], []).append(error)
        # The form to report: the one whose type the value has throughout, failing only a constraint ("" for a
        # non-empty string); else the only one the value entered (a list's items checked)
        clean = [form for form, group in by_form.items() if not any(map(_is_type_mismatch, group))]
        entered = [form for form, group in by_form.items() if any(len(_field_path(e)) > depth + 1 for e in group)]
        chosen = clean if len(clean) == 1 else entered if len(entered) == 1 else []
        if chosen:
            return describe_validation_error([_without_step(e, depth) for e in by_form[chosen[0]]])
        forms = ", ".join(dict.fromkeys(
            str(path[len(common)]).replace("constrained-", "") for path in siblings if len(path) > len(common)
        ))  # fmt: skip
        return f"invalid value for '{_dotted(common)}': it fits none of the accepted forms ({forms})", _dotted(common)
    param = _dotted(location)
    if kind == "extra_forbidden":
        return f"unknown field '{param}'; remove it (see GET /openapi.json for the accepted fields)", param
    if kind == "missing":
        return f"'{param}' is required", param
    return f"invalid value for '{param}': {_problem(first)}", param


def _is_form_name(step: Any) -> bool:
    """Whether a location step names a union's form as pydantic does (`str`, `list[int]`, `constrained-str`, a model's
    class name) rather than a field (a lower-case identifier) or a list index."""
    return isinstance(step, str) and (not step.isidentifier() or step in ("str", "int", "float", "bool", "none")
                                      or step[:1].isupper())  # fmt: skip


def _is_type_mismatch(error: dict) -> bool:
    """Whether the value is not even of the form's type (a string where a list is accepted): pydantic's `*_type`."""
    return str(error.get("type", "")).endswith("_type") or str(error.get("type", "")).startswith("union_tag_")


def _problem(error: dict) -> str:
    """What is wrong with one value, in words that say what to send instead where pydantic's do not."""
    kind, value, limits = error.get("type"), error.get("input"), error.get("ctx") or {}
    if kind == "string_unicode" and isinstance(value, str):  # the rule chat's rendering applies (errors.not_unicode)
        return f"it is not valid Unicode ({not_unicode(value) or 'not UTF-8'}); send UTF-8 text"
    if kind == "string_too_short" and limits.get("min_length") == 1:
        return "it is an empty string; give at least one character"
    if kind == "finite_number":
        return f"it must be a finite number, got {value!r}"
    if kind == "int_type" and isinstance(value, float):
        if value.is_integer():  # only past 64 bits: smaller integral floats are taken as integers
            return f"it must be an integer of at most 64 bits (-2**63 to 2**63-1), got {value!r}"
        return f"it must be a whole number, got {value!r}"
    return str(error.get("msg", "")).removeprefix("Value error, ")  # pydantic's wrapping of a validator's ValueError


def _without_step(error: dict, depth: int) -> dict:
    """`error` with the step at `depth` of its field path (a union form's name) left out of its location."""
    location = list(error.get("loc", ()))
    del location[len(location) - len(_field_path(error)) + depth]
    return {**error, "loc": tuple(location)}


def _is_union_member(path: tuple) -> bool:
    """Whether a path starts with the name pydantic gives a union's model (never a lower-case field name)."""
    return bool(path) and isinstance(path[0], str) and (path[0][:1].isupper() or path[0].startswith("function-"))


def _errors_of_the_closest_form(errors: list[dict]) -> list[dict]:
    """Of a body union's errors, those of the form the body comes closest to: the one missing fewest fields."""
    by_form: dict[str, list[dict]] = {}
    for error in errors:
        by_form.setdefault(str(_body_path(error)[0]), []).append(error)
    return min(by_form.values(), key=lambda group: sum(error.get("type") == "missing" for error in group))


def _body_path(error: dict) -> tuple:
    location = tuple(error.get("loc", ()))
    return location[1:] if location[:1] == ("body",) else location


def _field_path(error: dict) -> tuple:
    location = _body_path(error)
    return location[1:] if _is_union_member(location) else location  # the body is one of several models


def _common_prefix(paths: list[tuple]) -> tuple:
    prefix = paths[0]
    for path in paths[1:]:
        length = 0
        while length < min(len(prefix), len(path)) and prefix[length] == path[length]:
            length += 1
        prefix = prefix[:length]
    return prefix


def _dotted(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def _respond(request: Request, status_code: int, body: dict, headers: dict[str, str] | None = None) -> JSONResponse:
    """`body` (OpenAI's shape) as sent, or in Anthropic's shape on Anthropic's routes."""
    if is_anthropic_path(request.url.path):
        body = anthropic_error_body(body["error"]["message"], status_code)
    return AsciiJSONResponse(body, status_code=status_code, headers=headers)


async def _validation_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    message, param = describe_validation_error(errors) if errors else ("the request is invalid", None)
    if media_type := body_media_type_error(request.headers.get("content-type", ""), errors):
        message, param = f"send the body as JSON with Content-Type: application/json, not {media_type}", None
    return _respond(request, 400, error_body(message, "invalid_request_error", param))


async def _http_handler(request: Request, exc: HTTPException) -> JSONResponse:
    headers = {**(exc.headers or {}), **retry_after_headers(exc)}
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}; see GET /openapi.json"
        return _respond(request, 404, error_body(message, "invalid_request_error", None, "not_found"), headers)
    if exc.status_code == 405:  # `Allow` names the methods the path does take (RFC 9110)
        headers["Allow"] = _allowed_methods(request, headers.get("Allow", ""))
        message = f"method {request.method} is not allowed on {request.url.path}"
        return _respond(request, 405, error_body(message, "invalid_request_error", None, "method_not_allowed"), headers)
    message = _body_parse_problem(exc.__cause__) if exc.status_code == 400 else None
    return _respond(request, exc.status_code, error_body(message or str(exc.detail), "invalid_request_error"), headers)


def _body_parse_problem(cause: BaseException | None) -> str | None:
    """Why the JSON parser gave up on a body, for the errors FastAPI reports only as "an error parsing the body"."""
    if isinstance(cause, UnicodeDecodeError):
        byte = cause.object[cause.start : cause.start + 1].hex()
        return (f"the request body is not valid UTF-8: byte 0x{byte} at position {cause.start} ({cause.reason}); "
                "send the JSON encoded as UTF-8")  # fmt: skip
    if isinstance(cause, RecursionError):
        return ("the request body's JSON is nested too deeply to parse (objects and arrays inside one another); "
                "send a flatter body")  # fmt: skip
    if isinstance(cause, ValueError) and "digits" in str(cause):  # Python's cap on the digits of an integer
        return (f"the request body holds a number of more than {sys.get_int_max_str_digits()} digits, more than the "
                "parser takes; send a smaller one")  # fmt: skip
    return None


def _allowed_methods(request: Request, first_route_allows: str) -> str:
    """Every method the path takes. Starlette's `Allow` names the first matching route's methods only, so those of
    every documented route of the path are added (GET and DELETE on /v1/files/{file_id} are two routes)."""
    methods = {method.strip() for method in first_route_allows.split(",") if method.strip()}
    for template, operations in request.app.openapi().get("paths", {}).items():
        if compile_path(template)[0].match(request.url.path):
            methods |= {key.upper() for key in operations if key.upper() in HTTP_METHODS}
    return ", ".join(sorted(methods))


async def _engine_handler(request: Request, exc: Exception) -> JSONResponse:
    status_code, body = engine_error(exc)
    return _respond(request, status_code, body, retry_after_headers(exc))


async def _model_not_found_handler(request: Request, exc: ModelNotFound) -> JSONResponse:
    body = error_body(str(exc), "invalid_request_error", "model", "model_not_found")
    return _respond(request, 404, body, retry_after_headers(exc))


async def _disconnected_handler(request: Request, exc: ClientDisconnected) -> Response:
    return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"


async def answer_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _respond(request, 500, error_body("internal server error", "internal_error"), retry_after_headers(exc))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(HTTPException, _http_handler)
    app.add_exception_handler(PagedBackendError, _engine_handler)
    app.add_exception_handler(EngineStepFailed, _engine_handler)
    app.add_exception_handler(ModelNotFound, _model_not_found_handler)
    app.add_exception_handler(ClientDisconnected, _disconnected_handler)
    app.add_exception_handler(Exception, answer_unexpected)
