"""Several models behind one server: one engine, KV pool and engine thread per model; requests route by `model`.

Each model is a full single-model app (its own AsyncEngine thread, so engines step concurrently: torch ops
release the GIL; see benchmarks/RESULTS.md for the measurement). A pure-ASGI router in front reads the JSON
body's `model` (a served model or one of its LoRA adapters) and hands the request to that model's app; an
unknown model gets OpenAI's 404 naming the served ones. `/v1/models`, `/health` and `/metrics` (with vLLM's
`model_name` label) answer for all models. The KV budget is split by each model's share, so one model's
overload can only fill its own pool and queue, never another's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import Receive, Scope, Send

from paged_backend.config import EngineConfig
from paged_backend.errors import InvalidRequest
from paged_backend.lora.manager import served_adapters
from paged_backend.server import system_routes
from paged_backend.server.guard import RequestGuard, _reject, _replaying
from paged_backend.server.state import ServerSettings

SHARED_PATHS = ("/v1/models", "/health", "/metrics")


@dataclass
class ModelSpec:
    """One served model: its API name, engine options, and its share of the KV budget."""

    name: str
    config: EngineConfig
    share: float = 1.0


def read_models_file(path: str) -> list[dict]:
    """`models:` (YAML) or `[[models]]` (TOML): each entry `model`, optional `served_model_name`, `share` and any
    engine option (`max_num_seqs`, `enable_lora`, `lora_modules`, ...)."""
    from paged_backend.engine.args import read_document

    document = read_document(path)
    models = (document or {}).get("models") if isinstance(document, dict) else None
    if not isinstance(models, list) or not models or not all(isinstance(m, dict) for m in models):
        raise InvalidRequest(f"{path}: give a non-empty `models` list of tables, each with at least `model`")
    return models


def split_budget(specs: list[ModelSpec], total_bytes: int) -> list[ModelSpec]:
    """Give each model without an explicit pool size its share of `total_bytes` of KV memory."""
    total_share = sum(spec.share for spec in specs)
    sized = []
    for spec in specs:
        cache = spec.config.cache
        if cache.num_blocks is None and cache.kv_cache_memory_bytes is None:
            budget = int(total_bytes * spec.share / total_share)
            spec = replace(spec, config=spec.config.model_copy(update={"cache": cache.model_copy(
                update={"kv_cache_memory_bytes": budget})}))  # fmt: skip
        sized.append(spec)
    return sized


def check_names(specs: list[ModelSpec]) -> None:
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise InvalidRequest(f"served model names must differ, got {names}; set --served-model-name per model")


class ModelRouter:
    """ASGI: shared routes answered here, everything else forwarded to the app of the request's model."""

    def __init__(self, apps: dict[str, FastAPI], settings: ServerSettings) -> None:
        self.apps, self.default = apps, next(iter(apps))
        self.shared = _shared_app(apps)
        self.guard = RequestGuard(self._route, api_keys=settings.api_keys, max_concurrent_requests=None,
                                  max_request_body_bytes=settings.max_request_body_bytes,
                                  max_file_bytes=settings.max_file_bytes)  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self.shared(scope, receive, send)
        await self.guard(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in SHARED_PATHS:
            return await self.shared(scope, receive, send)
        message = await receive()  # the guard hands over the whole body in one message
        body = message.get("body", b"")
        model, lora_name = _body_fields(body)
        if model is None and lora_name is not None and self._app_for(lora_name) is not None:
            model = lora_name  # /v1/unload_lora_adapter without `model`: the model that holds the adapter
        name = model or self.default
        app = self._app_for(name)
        if app is None:
            served = ", ".join(f"'{n}'" for n in self._served_names())
            text = f"model '{name}' is not served here; this server serves {served}"
            return await _reject(send, scope["path"], 404, text, "invalid_request_error", "model_not_found")
        await app(scope, _replaying(body, receive), send)

    async def shutdown(self, drain_timeout: float) -> None:
        """Drain every model's engine at once (the draining server calls this on SIGTERM)."""
        engines = [app.state.server.async_engine for app in self.apps.values()]
        await asyncio.gather(*(engine.shutdown(drain_timeout) for engine in engines))

    def _app_for(self, name: str) -> FastAPI | None:
        if name in self.apps:
            return self.apps[name]
        for app in self.apps.values():  # a LoRA adapter of one of the models
            if name in served_adapters(app.state.server.async_engine.engine):
                return app
        return None

    def _served_names(self) -> list[str]:
        names = list(self.apps)
        for app in self.apps.values():
            names += served_adapters(app.state.server.async_engine.engine)
        return names


def _body_fields(body: bytes) -> tuple[str | None, str | None]:
    """The JSON body's `model` and `lora_name` (None where absent or not strings)."""
    try:
        document = json.loads(body) if body else None
    except ValueError:
        return None, None  # the model's own app answers the malformed body with its usual 400
    if not isinstance(document, dict):
        return None, None
    model, lora_name = document.get("model"), document.get("lora_name")
    return (model if isinstance(model, str) else None), (lora_name if isinstance(lora_name, str) else None)


def _shared_app(apps: dict[str, FastAPI]) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:  # every model's engine thread starts and drains with the server
            for app in apps.values():
                await stack.enter_async_context(app.router.lifespan_context(app))
            yield

    shared = FastAPI(title="paged-backend", lifespan=lifespan)
    states = {name: app.state.server for name, app in apps.items()}
    shared.state.server = next(iter(states.values()))  # the draining server reads the first engine

    @shared.get("/v1/models")
    async def list_models() -> JSONResponse:
        cards = []
        for state in states.values():
            cards += json.loads((await system_routes.list_models(state)).body)["data"]
        return JSONResponse({"object": "list", "data": cards})

    @shared.get("/health")
    async def health() -> JSONResponse:
        models = {}
        for name, state in states.items():
            response = await system_routes.health(state)
            models[name] = {"status_code": response.status_code, **json.loads(response.body)}
        healthy = all(model["status_code"] == 200 for model in models.values())
        return JSONResponse({"status": "ok" if healthy else "degraded", "models": models},
                            status_code=200 if healthy else 503)  # fmt: skip

    @shared.get("/metrics")
    async def metrics() -> Response:
        return Response(labelled_exposition(states), media_type=CONTENT_TYPE_LATEST)

    return shared


class _Families:
    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return self.families


def labelled_exposition(states: dict) -> bytes:
    """Every model's metrics in one exposition, each sample labelled with vLLM's `model_name`."""
    merged: dict[str, object] = {}
    for name, state in states.items():
        for family in text_string_to_metric_families(state.metrics.exposition().decode()):
            samples = [sample._replace(labels={"model_name": name, **sample.labels}) for sample in family.samples]
            if family.name in merged:
                merged[family.name].samples += samples
            else:
                family.samples = samples
                merged[family.name] = family
    registry = CollectorRegistry()
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)


def build_multi_model_app(engines: dict, settings: ServerSettings) -> ModelRouter:
    """The router over one single-model app per `{served name: Engine}`; their batch lines enter through it."""
    from paged_backend.server.app import build_app
    from paged_backend.server.batch_runner import send_lines_through

    apps = {name: build_app(engine, replace(settings, served_model_name=name)) for name, engine in engines.items()}
    router = ModelRouter(apps, settings)
    send_lines_through(router, apps.values())  # a batch line runs on the model its body names
    return router


def model_specs(base: EngineConfig, models: list[str], names: list[str], config_file: str | None) -> list[ModelSpec]:
    """Specs from repeated `--model` / `--served-model-name` (engine flags shared, equal shares) or a config file.
    A KV memory budget in `base` is the total that `build_engines` splits, so no model inherits it whole."""
    base = base.model_copy(update={"cache": base.cache.model_copy(update={"kv_cache_memory_bytes": None})})
    if config_file is not None and (models or names):
        raise InvalidRequest("give the models either with --model / --served-model-name or in --config, not both")
    if config_file is not None:
        specs = []
        for entry in read_models_file(config_file):
            options = dict(entry)
            name = options.pop("served_model_name", None) or options.get("model")
            share = float(options.pop("share", 1.0))
            flat = {**_flat(base), **options}
            from paged_backend.engine import engine_config

            specs.append(ModelSpec(str(name), engine_config(**flat), share))
    else:
        if names and len(names) != len(models):
            raise InvalidRequest(f"{len(names)} --served-model-name for {len(models)} --model; give one per model")
        names = names or models
        specs = [ModelSpec(name, base.model_copy(update={"model": model}, deep=True)) for model, name in
                 zip(models, names, strict=True)]  # fmt: skip
    check_names(specs)
    return specs


def _flat(config: EngineConfig) -> dict:
    """An EngineConfig as the flat keywords `engine_config` takes."""
    nested = ("cache", "scheduler", "parallel")
    values = config.model_dump(exclude=set(nested))
    for name in nested:
        values.update(getattr(config, name).model_dump())
    return values


def kv_budget(config: EngineConfig) -> int:
    """The KV bytes all models share: the single-model default budget (`core.kv_budget`), once."""
    from paged_backend.core.kv_budget import kv_memory_bytes
    from paged_backend.worker.models import resolve_device

    cache = config.cache
    return kv_memory_bytes(resolve_device(config.device), cache.kv_cache_memory_bytes, cache.gpu_memory_utilization)


def build_engines(base: EngineConfig, specs: list[ModelSpec]) -> dict:
    """One Engine per model, its pool sized by its share of one budget (an explicit per-model pool size wins)."""
    from paged_backend.engine import Engine

    return {spec.name: Engine(spec.config) for spec in split_budget(specs, kv_budget(base))}
