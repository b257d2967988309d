"""The TGI face's `/openapi.json`, made to say what the server does.

FastAPI derives the request shapes from `http/schemas.py`; this module adds what it cannot know: each field's range
(from the router limits, checked in `http/validation.py` with TGI's messages), the error body and every status a
route answers, and the media types served (SSE streams, Prometheus text, empty health answers).
Cross-field rules (the token budget, best_of with sampling, a grammar that compiles) are described, not encoded.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from paged_backend.tgi.http.settings import RouterSettings

U64_MAX = 2**64 - 1
ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
ERROR_RESPONSE_SCHEMA = {
    "type": "object",
    "title": "ErrorResponse",
    "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}},
    "required": ["error", "error_type"],
}
SSE_EVENT = {
    "type": "object",
    "description": "one server-sent event; `data` holds a JSON object (or `[DONE]` on the OpenAI routes)",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
    "required": ["data"],
}
SSE = {"text/event-stream": {"schema": SSE_EVENT}}


def _json(schema: dict | None = None) -> dict:
    return {"application/json": {"schema": schema or {}}}


def _error(description: str) -> dict:
    return {"description": description, "content": _json(ERROR_REF)}


def _body_errors(settings: RouterSettings) -> dict:
    """What every route with a JSON body can answer besides success."""
    responses = {
        "400": _error("The body is not JSON"),
        "413": _error(f"The body is larger than {settings.payload_limit} bytes"),
        "422": _error("Input validation error: a field out of range, or a rule across fields (token budget, ...)"),
    }
    if settings.api_key:
        responses["401"] = {"description": "Missing or wrong `Authorization: Bearer <api key>`"}
    return responses


def _generation_errors(settings: RouterSettings) -> dict:
    return {
        **_body_errors(settings),
        "424": _error("Request failed during generation"),
        "429": _error("Model is overloaded: `max_concurrent_requests` requests are in flight"),
        "500": _error("Incomplete generation: the backend ended the stream early"),
    }


def _responses(settings: RouterSettings) -> dict[tuple[str, str], dict]:
    generate = {
        "type": "object",
        "properties": {"generated_text": {"type": "string"}, "details": {"type": "object"}},
        "required": ["generated_text"],
    }
    token_piece = {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "text": {"type": "string"},
            "start": {"type": "integer"},
            "stop": {"type": "integer"},
        },
        "required": ["id", "text", "start", "stop"],
    }
    healthy = {"200": {"description": "Healthy (empty body)"}, "503": _error("Unhealthy")}
    chat_like = {"200": {"description": "A completion, or its SSE stream with `stream`", "content": {**_json(), **SSE}}}
    generation = _generation_errors(settings)
    return {
        ("/generate", "post"): {"200": {"description": "The generation", "content": _json(generate)}, **generation},
        ("/generate_stream", "post"): {
            "200": {"description": "One SSE event per token; later failures arrive as error events", "content": SSE},
            **generation,
        },
        ("/", "post"): {
            "200": {
                "description": "A one-element list of generations, or an SSE stream with `stream`",
                "content": {**_json({"type": "array", "items": generate, "minItems": 1, "maxItems": 1}), **SSE},
            },
            **generation,
        },
        ("/", "get"): healthy,
        ("/health", "get"): healthy,
        ("/ping", "get"): healthy,
        ("/tokenize", "post"): {
            "200": {
                "description": "The tokens with character offsets",
                "content": _json({"type": "array", "items": token_piece}),
            },
            **_body_errors(settings),
        },
        ("/chat_tokenize", "post"): {
            "200": {"description": "The templated prompt and its tokens", "content": _json({"type": "object"})},
            **_body_errors(settings),
        },
        ("/v1/chat/completions", "post"): {**chat_like, **generation},
        ("/v1/completions", "post"): {**chat_like, **generation},
        ("/invocations", "post"): {**chat_like, **generation},
        ("/info", "get"): {"200": {"description": "Model and router limits", "content": _json({"type": "object"})}},
        ("/v1/models", "get"): {"200": {"description": "The served model", "content": _json({"type": "object"})}},
        ("/metrics", "get"): {
            "200": {
                "description": "Prometheus text exposition",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    }


def _constrain(schema: dict, field: str, **constraints: Any) -> None:
    """Add `constraints` to `field`'s non-null type (FastAPI writes optional fields as anyOf [T, null])."""
    prop = schema["properties"][field]
    options = prop.get("anyOf", [prop])
    for option in options:
        if option.get("type") != "null" and "$ref" not in option:
            option.update(constraints)


def _constrain_fields(schema: dict, rules: dict[str, dict[str, Any]]) -> None:
    for field, constraints in rules.items():
        _constrain(schema, field, **constraints)


def _constrain_stop(schema: dict, settings: RouterSettings) -> None:
    for option in schema["properties"]["stop"]["anyOf"]:
        if option.get("type") == "array":
            option.update(maxItems=settings.max_stop_sequences, items={"type": "string", "minLength": 1})
        elif option.get("type") == "string":
            option["minLength"] = 1


def _request_constraints(components: dict, settings: RouterSettings) -> None:
    max_new_tokens = settings.max_total_tokens - 1  # at least one prompt token always takes a slot
    _constrain_fields(
        components["GenerateParameters"],
        {
            "best_of": {"minimum": 1, "maximum": settings.max_best_of},
            "temperature": {"exclusiveMinimum": 0},
            "repetition_penalty": {"exclusiveMinimum": 0},
            "frequency_penalty": {"minimum": -2, "maximum": 2},
            "top_k": {"minimum": 1},
            "top_p": {"exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "typical_p": {"exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "max_new_tokens": {"minimum": 1, "maximum": max_new_tokens},
            "stop": {"maxItems": settings.max_stop_sequences, "items": {"type": "string", "minLength": 1}},
            "truncate": {"minimum": 1, "maximum": settings.max_input_tokens},
            "seed": {"minimum": 0, "maximum": U64_MAX},
            "top_n_tokens": {"minimum": 0, "maximum": settings.max_top_n_tokens},
        },
    )
    for name in ("GenerateRequest", "CompatGenerateRequest"):
        _constrain(components[name], "inputs", minLength=1)
    # The OpenAI bodies' shared fields, with the same ranges on both routes.
    openai_rules = {
        "temperature": {"minimum": 0},
        "top_p": {"exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "frequency_penalty": {"minimum": -2, "maximum": 2},
        "max_tokens": {"minimum": 1, "maximum": max_new_tokens},
        "seed": {"minimum": 0, "maximum": U64_MAX},
    }
    chat = components["ChatRequest"]
    chat["properties"]["messages"]["minItems"] = 1
    _constrain_fields(
        chat,
        {
            **openai_rules,
            "presence_penalty": {"exclusiveMinimum": -2, "maximum": 2},
            "max_completion_tokens": {"minimum": 1, "maximum": max_new_tokens},
            "top_logprobs": {"minimum": 0, "maximum": settings.max_top_n_tokens},
        },
    )
    _constrain_stop(chat, settings)
    completion = components["CompletionRequest"]
    _constrain_fields(completion, {**openai_rules, "repetition_penalty": {"exclusiveMinimum": 0}})
    for option in completion["properties"]["prompt"]["anyOf"]:
        if option.get("type") == "string":
            option["minLength"] = 1
        else:
            option.update(minItems=1, maxItems=settings.max_client_batch_size)
            option["items"]["minLength"] = 1
    _constrain_stop(completion, settings)
    completion["properties"]["suffix"] = {"type": "null", "description": "not supported: must be absent or null"}


def openapi_document(app: FastAPI, settings: RouterSettings) -> dict:
    """FastAPI's document with the router's limits, TGI's error body and every served status and media type."""
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = document["components"]["schemas"]
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    components["ErrorResponse"] = ERROR_RESPONSE_SCHEMA
    _request_constraints(components, settings)
    for (path, method), responses in _responses(settings).items():
        document["paths"][path][method]["responses"] = responses
    # /invocations reads its body itself: chat bodies (with "messages") or the compat generate body.
    either = {"anyOf": [{"$ref": f"#/components/schemas/{name}"} for name in ("ChatRequest", "CompatGenerateRequest")]}
    document["paths"]["/invocations"]["post"]["requestBody"] = {"required": True, "content": _json(either)}
    return document
