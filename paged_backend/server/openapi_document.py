"""What /openapi.json says the server answers, made to agree with what it does.

FastAPI's defaults disagree with this server: they document 422 for invalid bodies (the server answers 400 with
OpenAI's error object), omit the statuses the request guard answers (401, 413, 429), and do not know that
generation routes stream `text/event-stream` when asked to. `install_openapi` rewrites the document once, for
every route, so a route needs no annotations of its own.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from paged_backend.server.guard import GENERATION_PATHS

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error object: every 4xx and 5xx this server sends carries one."""

    error: ErrorDetail


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ERROR_REF}}}


BODY_ERRORS = {
    "400": _error("The body is not valid: the message and `param` name what to change"),
    "404": _error("The request names a model this server does not serve"),
    "413": _error("The body is larger than --max-request-body-bytes"),
}
API_KEY_ERROR = {"401": _error("Missing or wrong API key (when the server runs with --api-key)")}
GENERATION_ERRORS = {
    "429": _error("Too many requests in flight (--max-concurrent-requests), or no room in the KV cache"),
    "503": _error("The server is shutting down"),
}
# One server-sent event: `data` holds a JSON chunk, and the last one `[DONE]`.
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
EVENT_STREAM = {"text/event-stream": {"schema": SSE_EVENT}}


def truthful_document(document: dict[str, Any]) -> dict[str, Any]:
    """`document` (FastAPI's) with the statuses and media types this server really answers with."""
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error_schema.pop("$defs", {}))
    schemas["ErrorResponse"] = error_schema
    for path, path_item in document.get("paths", {}).items():
        for operation in path_item.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if "requestBody" in operation:
                responses.update(BODY_ERRORS)
            if path.startswith("/v1/"):
                responses.update(API_KEY_ERROR)
            if path in GENERATION_PATHS:
                responses.update(GENERATION_ERRORS)
                responses["200"]["description"] = "The response object, or with `stream: true` a stream of chunks"
                responses["200"].setdefault("content", {}).update(EVENT_STREAM)
    return document


def install_openapi(app: FastAPI) -> None:
    """Serve `truthful_document` at /openapi.json (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = truthful_document(document)
        return app.openapi_schema

    app.openapi = openapi
