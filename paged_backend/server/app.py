"""The FastAPI app: OpenAI routes, /health, /metrics, around one AsyncEngine.

>>> from paged_backend.engine import Engine                      # doctest: +SKIP
>>> app = build_app(Engine(), ServerSettings(api_key="secret"))  # doctest: +SKIP
>>> uvicorn.run(app, port=8000)                                  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from paged_backend import __version__
from paged_backend.engine.async_engine import AsyncEngine, EngineThread
from paged_backend.engine.unhandled import AnswerUnhandled
from paged_backend.observability.metrics import ServerMetrics
from paged_backend.observability.stats_log import StatsLogger
from paged_backend.observability.tracing import RequestTracer, TraceHeaders, otlp_tracer
from paged_backend.server import (
    batches,
    chat,
    completions,
    debug_routes,
    files,
    lora_routes,
    messages,
    responses,
    sleep_routes,
    system_routes,
    utility_routes,
)
from paged_backend.server.batch_runner import BatchRunner
from paged_backend.server.generation import prompt_tokens_details
from paged_backend.server.guard import RequestGuard
from paged_backend.server.openai_errors import answer_unexpected, install_error_handlers
from paged_backend.server.openapi_document import install_openapi
from paged_backend.server.request_log import RequestLoggingEngine
from paged_backend.server.schemas import strict_fields
from paged_backend.server.state import ServerSettings, ServerState
from paged_backend.worker.default_model import served_name

if TYPE_CHECKING:
    from paged_backend.engine import Engine


def build_app(
    engine: Engine,
    settings: ServerSettings,
    tracer: RequestTracer | None = None,
    engine_thread: EngineThread | None = None,
) -> FastAPI:
    """An app serving `engine`; the engine loop starts and drains with the app's lifespan. Request spans go to
    `tracer`, or to settings.otlp_traces_endpoint. `engine_thread`: the thread that built the engine, to step it."""
    async_engine = (
        RequestLoggingEngine(engine, engine_thread, settings.max_log_len)
        if settings.enable_log_requests
        else AsyncEngine(engine, engine_thread)
    )
    model_name, *aliases = settings.served_names or [served_name(engine.config.model)]
    if tracer is None and settings.otlp_traces_endpoint:
        tracer = otlp_tracer(settings.otlp_traces_endpoint, "paged-backend")
    state = ServerState(settings, async_engine, ServerMetrics(async_engine, model_name, tracer), model_name,
                        tuple(aliases))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await async_engine.start()
        # resumes the batches a stop interrupted; one per server (several models: the first model's app runs them)
        batch_runner = BatchRunner(app) if getattr(app.state, "runs_batches", True) else None
        if batch_runner is not None:
            batch_runner.start()
        stats_logger = None  # vLLM's periodic stats line, unless --disable-log-stats
        if not settings.disable_log_stats:
            stats_logger = StatsLogger(async_engine, settings.log_stats_interval, model_name)
            stats_logger.start()
        yield
        if stats_logger is not None:
            await stats_logger.stop()
        if batch_runner is not None:
            await batch_runner.stop()
        await async_engine.shutdown(settings.drain_timeout)
        if tracer is not None:
            tracer.shutdown()

    app = FastAPI(title="paged-backend", version=__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    install_openapi(app)
    for module in (completions, chat, responses, messages, files, batches, sleep_routes, utility_routes, system_routes):
        app.include_router(module.router)
    if settings.enable_debug_routes:
        app.include_router(debug_routes.router)
    if settings.enable_tokenizer_info_endpoint:
        app.include_router(utility_routes.tokenizer_info_router)
    if lora_routes.runtime_updating_allowed(settings.allow_runtime_lora_updating):
        app.include_router(lora_routes.router)
    app.add_middleware(FieldPolicy, strict=settings.strict_fields, details=settings.enable_prompt_tokens_details)
    app.add_middleware(
        RequestGuard,
        api_keys=settings.api_keys,
        max_request_body_bytes=settings.max_request_body_bytes,
        max_concurrent_requests=settings.max_concurrent_requests,
        max_file_bytes=settings.max_file_bytes,
    )
    app.add_middleware(TraceHeaders)
    app.add_middleware(AnswerUnhandled, answer=answer_unexpected)  # a bug's 500 keeps the connection
    app.add_middleware(CORSMiddleware, **settings.cors_options)  # preflights need no key, 500s get CORS
    if settings.root_path:
        app.add_middleware(RootPath, root_path=settings.root_path)  # outermost: every layer sees the route's path
    return app


class FieldPolicy:
    """Pure ASGI: tells the request models whether unknown fields are a 400, and usage whether it carries
    prompt_tokens_details (`--enable-prompt-tokens-details`), through context variables."""

    def __init__(self, app: ASGIApp, *, strict: bool, details: bool = False) -> None:
        self.app, self.strict, self.details = app, strict, details

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        strict_fields.set(self.strict)  # this request's task only
        prompt_tokens_details.set(self.details)
        await self.app(scope, receive, send)


class RootPath:
    """Pure ASGI, vLLM's `--root-path`: the prefix a path-routing proxy serves the server under. A request comes
    with it (a proxy that forwards the whole path) or without it (one that strips it), as FastAPI's root_path takes
    both; the layers inside (API-key guard, multi-model router, routes) see the path without it, and
    scope["root_path"] carries it (the OpenAPI document's server URL)."""

    def __init__(self, app: ASGIApp, *, root_path: str) -> None:
        self.app, self.root_path = app, root_path.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self.root_path:
            path = scope["path"]
            if path == self.root_path or path.startswith(self.root_path + "/"):
                path = path[len(self.root_path) :] or "/"
            scope = {**scope, "path": path, "raw_path": path.encode(), "root_path": self.root_path}
        await self.app(scope, receive, send)
