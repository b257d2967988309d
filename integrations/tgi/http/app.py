"""The TGI HTTP API on any backend: `create_app(backend, settings)` returns the FastAPI app.

Routes, defaults, SSE framing, error bodies and status codes follow TGI's router (`server.rs`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError as PydanticValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from paged_backend import __version__
from paged_backend.engine.disconnect import ClientDisconnected, cancel_on_disconnect
from paged_backend.engine.unhandled import AnswerUnhandled, log_and_answer_500
from paged_backend.errors import body_media_type_error
from paged_backend.observability.tracing import RequestTracer, TraceHeaders
from paged_backend.tgi.backends.base import Backend
from paged_backend.tgi.http import openai_routes
from paged_backend.tgi.http.errors import TgiError, UnhealthyError
from paged_backend.tgi.http.infer import Infer
from paged_backend.tgi.http.metrics import TgiMetrics
from paged_backend.tgi.http.openapi import openapi_document
from paged_backend.tgi.http.responses import generate_json, stream_json, timing_headers
from paged_backend.tgi.http.schemas import ChatRequest, CompatGenerateRequest, GenerateRequest, TokenizeRequest
from paged_backend.tgi.http.settings import RouterSettings
from paged_backend.tgi.http.sse import event, sse_response
from paged_backend.tgi.http.validation import check_unicode, validate_stream

DRAIN_TIMEOUT_SECONDS = 90.0  # TGI's --graceful-termination-timeout default


def create_app(
    backend: Backend,
    settings: RouterSettings,
    drain_timeout: float = DRAIN_TIMEOUT_SECONDS,
    tracer: RequestTracer | None = None,
) -> FastAPI:
    metrics = TgiMetrics(settings.max_input_tokens, settings.max_total_tokens)
    infer = Infer(backend, settings, metrics, tracer)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.start(metrics)
        yield
        await backend.shutdown(drain_timeout)
        if tracer is not None:
            tracer.shutdown()

    app = FastAPI(title="paged-backend (TGI API)", version=__version__, lifespan=lifespan)
    app.state.infer = infer
    app.state.settings = settings

    @app.exception_handler(TgiError)
    async def tgi_error(request: Request, error: TgiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status_code)

    @app.exception_handler(ClientDisconnected)
    async def disconnected(request: Request, error: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(RequestValidationError)
    async def body_error(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        if body_media_type_error(request.headers.get("content-type", ""), errors):
            return _error_response(415, "Expected request with `Content-Type: application/json`")  # axum's words
        if any(e["type"] == "json_invalid" for e in errors):  # axum: syntax errors are 400, shape errors 422
            return _error_response(400, f"Failed to parse the request body as JSON: {errors[0]['msg']}")
        problems = "; ".join(f"{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in errors)
        return _error_response(422, f"Failed to deserialize the JSON body into the target type: {problems}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        headers = dict(error.headers or {})
        if error.status_code == 405:  # name every method the path serves, not only the first route's
            headers["Allow"] = ", ".join(_allowed_methods(app, request))
        if error.status_code == 400:
            return _error_response(400, f"Failed to parse the request body: {error.detail}", headers)
        return JSONResponse({"error": str(error.detail), "error_type": "http"}, error.status_code, headers)

    @app.middleware("http")
    async def payload_limit(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.payload_limit:
            return _error_response(413, f"the body is larger than the {settings.payload_limit} bytes allowed")
        return await call_next(request)

    def require_api_key(request: Request) -> None:
        if settings.api_key and request.headers.get("authorization") != f"Bearer {settings.api_key}":
            raise _Unauthorized()

    @app.exception_handler(_Unauthorized)
    async def unauthorized(request: Request, error: _Unauthorized) -> Response:
        return Response(status_code=401)

    guarded = [Depends(require_api_key)]

    async def generate_response(body: GenerateRequest, default_full_text: bool, http: Request) -> tuple[dict, dict]:
        start = time.monotonic()
        with infer.permit():
            request = infer.validate(body.inputs, body.parameters)
            validation_time = time.monotonic() - start
            # a client that hangs up is aborted at once, its permit and blocks freed (streams notice by themselves)
            generation, others = await cancel_on_disconnect(http, infer.generate(request))
        params = body.parameters
        full_text = params.return_full_text if params.return_full_text is not None else default_full_text
        with_details = params.details or params.decoder_input_details
        payload = generate_json(generation, body.inputs if full_text else "", with_details, others)
        headers = timing_headers(generation, backend.name, validation_time, time.monotonic() - start)
        return payload, headers

    def open_stream(body: GenerateRequest, default_full_text: bool, headers: dict | None = None) -> Response:
        """Validation fails with its status before the stream opens; later failures are error events (as TGI)."""
        params = body.parameters
        full_text = params.return_full_text if params.return_full_text is not None else default_full_text
        validate_stream(params)
        request = infer.validate(body.inputs, params)

        async def frames() -> AsyncIterator[str]:
            try:
                with infer.permit():
                    async with contextlib.aclosing(infer.stream(request)) as steps:
                        async for step in steps:
                            yield event(stream_json(step, body.inputs if full_text else "", params.details))
            except TgiError as error:
                yield event(error.body())

        return sse_response(frames(), headers)

    @app.post("/generate", dependencies=guarded)
    async def generate(body: GenerateRequest, http: Request) -> JSONResponse:
        payload, headers = await generate_response(body, False, http)
        return JSONResponse(payload, headers=headers)

    @app.post("/generate_stream", dependencies=guarded)
    async def generate_stream(body: GenerateRequest) -> Response:
        return open_stream(body, default_full_text=False, headers={"x-compute-type": backend.name})

    @app.post("/", dependencies=guarded)
    async def compat_generate(body: CompatGenerateRequest, http: Request) -> Response:
        if body.stream:
            return open_stream(body, settings.compat_return_full_text)
        payload, headers = await generate_response(body, settings.compat_return_full_text, http)
        return JSONResponse([payload], headers=headers)

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        encoding = infer.tokenizer(check_unicode(body.inputs), return_offsets_mapping=True)
        pieces = [
            {"id": token_id, "text": body.inputs[start:stop], "start": start, "stop": stop}
            for token_id, (start, stop) in zip(encoding.input_ids, encoding.offset_mapping, strict=True)
        ]
        return JSONResponse(pieces)

    chat_completions = openai_routes.register(app, infer, settings, guarded)

    @app.post("/invocations", dependencies=guarded)
    async def invocations(request: Request) -> Response:
        """SageMaker's one route: chat bodies (with "messages") go to chat completions, the rest to `/`."""
        try:
            payload = await request.json()
        except ValueError as error:
            return _error_response(400, f"Failed to parse the request body as JSON: {error}")
        model = ChatRequest if isinstance(payload, dict) and "messages" in payload else CompatGenerateRequest
        try:
            body = model.model_validate(payload)
        except PydanticValidationError as error:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in error.errors()]) from error
        if isinstance(body, ChatRequest):
            return await chat_completions(body, request)
        return await compat_generate(body, request)

    @app.get("/info")
    async def info() -> JSONResponse:
        return JSONResponse(
            {
                "model_id": settings.model_id,
                "model_sha": None,
                "model_pipeline_tag": "text-generation",
                "max_concurrent_requests": settings.max_concurrent_requests,
                "max_best_of": settings.max_best_of,
                "max_stop_sequences": settings.max_stop_sequences,
                "max_input_tokens": settings.max_input_tokens,
                "max_total_tokens": settings.max_total_tokens,
                "validation_workers": settings.validation_workers,
                "max_client_batch_size": settings.max_client_batch_size,
                "router": "text-generation-router",
                "version": __version__,
                "sha": None,
                "docker_label": None,
                "backend": backend.name,
            }
        )

    async def health_response() -> Response:
        if not await backend.health():
            raise UnhealthyError()
        return Response(status_code=200)

    app.add_api_route("/health", health_response, methods=["GET"])
    app.add_api_route("/ping", health_response, methods=["GET"])
    app.add_api_route("/", health_response, methods=["GET"])

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        load = backend.load()
        metrics.queue_size.set(load.queue_size)
        metrics.batch_current_size.set(load.batch_size)
        metrics.batch_current_max_tokens.set(load.kv_tokens_used)
        metrics.batch_max_total_tokens.set(load.kv_tokens_total)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        model = {"id": settings.model_id, "object": "model", "created": 0, "owned_by": settings.model_id}
        return JSONResponse({"object": "list", "data": [model]})

    async def unexpected(request: Request, error: Exception) -> Response:
        metrics.request_failure.inc(err="internal")
        return await log_and_answer_500(request, error, {"error": "internal server error", "error_type": "internal"})

    app.openapi = lambda: app.openapi_schema or _cache_openapi(app, settings)
    app.add_middleware(TraceHeaders)
    app.add_middleware(AnswerUnhandled, answer=unexpected)  # outermost: a bug's 500 keeps the connection
    return app


def _cache_openapi(app: FastAPI, settings: RouterSettings) -> dict:
    app.openapi_schema = openapi_document(app, settings)
    return app.openapi_schema


def _error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": "validation"}, status_code=status, headers=headers)


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """Methods of every route on the request's path (a 405 must list them all in `Allow`)."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(request.scope)  # PARTIAL: the path matches, the method does not
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


class _Unauthorized(Exception):
    """Missing or wrong `Authorization: Bearer <api key>`; TGI answers 401 with an empty body."""
