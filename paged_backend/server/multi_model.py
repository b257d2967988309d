"""Several models behind one server: one engine, KV pool and engine thread per model; requests route by `model`.

Each model is a full single-model app (its own AsyncEngine thread, so engines step concurrently: torch ops
release the GIL; see benchmarks/RESULTS.md for the measurement). A pure-ASGI router in front reads the JSON
body's `model` (a served model or one of its LoRA adapters) and hands the request to that model's app; an
unknown model gets OpenAI's 404 naming the served ones. `/v1/models`, `/health` and `/metrics` (with vLLM's
`model_name` label) answer for all models. The KV budget is split by each model's share, so one model's
overload can only fill its own pool and queue, never another's.

A models file entry (`models:` in YAML, `[[models]]` in TOML) takes `model`, `served_model_name` (one name, or
several as vLLM's --served-model-name takes them: the first answers, all route to the model), `share` and any
engine option, each key spelled as its field or its flag, with - or _ (vLLM's config files use both);
`lora_modules` in the forms --lora-modules takes. A key set to null is not given. Anything else is refused in one
line naming the entry and the key.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import math
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from starlette.middleware.cors import CORSMiddleware
from starlette.types import Receive, Scope, Send

from paged_backend.config import EngineConfig
from paged_backend.errors import InvalidRequest, one_line
from paged_backend.lora.manager import served_adapters
from paged_backend.lora.request import parse_lora_modules
from paged_backend.server import system_routes
from paged_backend.server.guard import RequestGuard, _reject, _replaying
from paged_backend.server.state import ServerSettings

SHARED_PATHS = ("/v1/models", "/health", "/metrics")


@dataclass
class ModelSpec:
    """One served model: its API name (and further names requests may use), engine options, and its share of the
    KV budget."""

    name: str
    config: EngineConfig
    share: float = 1.0
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def read_models_file(path: str) -> list[dict]:
    """`models:` (YAML) or `[[models]]` (TOML): each entry `model`, optional `served_model_name`, `share` and any
    engine option (`max_num_seqs`, `enable_lora`, `lora_modules`, ...)."""
    from paged_backend.engine.args import read_document

    document = read_document(path)
    models = (document or {}).get("models") if isinstance(document, dict) else None
    if not isinstance(models, list) or not models:
        raise InvalidRequest(f"{path}: give a non-empty `models` list of tables, each with at least `model`")
    for index, entry in enumerate(models):
        if not isinstance(entry, dict):
            raise InvalidRequest(f"{path}: models[{index}] is {entry!r}; each entry is a table with at least `model`")
    return models


ENTRY_KEYS = ("model", "served_model_name", "share")  # an entry's own keys; the rest are engine options
LORA_FORMS = "name=path, {name: NAME, path: PATH}, a list of those, or a table {NAME: PATH}"


def _entry_keys() -> dict[str, str]:
    """Every key an entry may use, underscored, -> the field it sets: the field's name and each long flag's name
    (`kv_cache_dtype` sets `cache_dtype`, `scheduling_policy` sets `policy`)."""
    from paged_backend.engine.args import option_fields

    return {**{key: key for key in ENTRY_KEYS}, **option_fields()}


def _positive_share(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise InvalidRequest(f"{where}: `share` must be a positive number (its part of the KV budget), got {value!r}")
    return float(value)


def _served_names(value: Any, where: str, key: str) -> list[str]:
    """`served_model_name`: one name, or a list of them (vLLM's --served-model-name a b)."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(name, str) and name for name in names):
        raise InvalidRequest(f"{where}: `{key}` must be a name or a non-empty list of names, got {value!r}")
    return names


def _lora_modules(value: Any, where: str, key: str) -> dict[str, str]:
    """`lora_modules` in the forms --lora-modules takes (`name=path`, or JSON / a table with `name` and `path`; one
    or a list), or a table {name: path}."""
    if isinstance(value, dict) and not {"name", "path"} <= set(value):  # {name: path, ...}
        if not all(isinstance(name, str) and name and isinstance(path, str) and path for name, path in value.items()):
            raise InvalidRequest(f"{where}: `{key}` {value!r}: give {LORA_FORMS}")
        return dict(value)
    modules: dict[str, str] = {}
    for item in value if isinstance(value, list) else [value]:
        flag_value = json.dumps(item, default=str) if isinstance(item, dict) else item
        try:
            if not isinstance(flag_value, str):
                raise InvalidRequest(f"not a string: {flag_value!r}")
            modules.update(parse_lora_modules([flag_value]))
        except InvalidRequest as error:
            raise InvalidRequest(f"{where}: `{key}` {item!r} is no adapter; give {LORA_FORMS}") from error
    return modules


def entry_spec(base: EngineConfig, entry: dict, where: str) -> ModelSpec:
    """One models-file entry as a spec: its options over `base`'s (the flags every model shares). `where` names
    the entry in errors (`models.yaml: models[1]`)."""
    from paged_backend.engine import engine_config

    keys = _entry_keys()
    given: dict[str, Any] = {}
    spelled: dict[str, str] = {}  # field -> the key as the entry wrote it
    for key, value in entry.items():
        field = keys.get(str(key).replace("-", "_"))
        if field is None:
            close = difflib.get_close_matches(str(key).replace("-", "_"), keys, n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            raise InvalidRequest(f"{where}: unknown key `{key}`; {hint}an entry takes `model`, `served_model_name`, "
                                 "`share` and engine options by their flag names (`max_num_seqs` or `max-num-seqs`)")
        if field in spelled:
            raise InvalidRequest(f"{where}: `{field}` is given twice (as `{spelled[field]}` and `{key}`); keep one")
        spelled[field] = str(key)
        if value is not None:  # null: not given, as in a --config file
            given[field] = value
    model = given.pop("model", None)
    if not isinstance(model, str) or not model:
        said = "no `model`" if model is None else f"`{spelled['model']}` must be a string, got {model!r}"
        raise InvalidRequest(f"{where}: {said}; give the model to serve: a local directory, hub id or .gguf file")
    names = _served_names(given.pop("served_model_name"), where, spelled["served_model_name"]) if (
        "served_model_name" in given) else [model]  # fmt: skip
    share = _positive_share(given.pop("share", 1.0), where)
    if "lora_modules" in given:
        given["lora_modules"] = _lora_modules(given["lora_modules"], where, spelled["lora_modules"])
    try:
        config = engine_config(**{**_flat(base), **given, "model": model})
    except ValidationError as error:
        flags = {field: f"`{key}`" for field, key in spelled.items()}  # name the entry's keys, not the flags
        raise InvalidRequest(f"{where}: {one_line(error, flags)}") from error
    except InvalidRequest as error:
        raise InvalidRequest(f"{where}: {error}") from error
    return ModelSpec(names[0], config, share, tuple(names[1:]))


def split_budget(specs: list[ModelSpec], total_bytes: int) -> list[ModelSpec]:
    """Give each model without an explicit pool size its share of `total_bytes` of KV memory."""
    total_share = sum(_positive_share(spec.share, f"model '{spec.name}'") for spec in specs)
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
    """Every served name (aliases too) routes to one model."""
    models = {}
    for index, spec in enumerate(specs):
        for name in dict.fromkeys(spec.names):  # a name repeated within one model is harmless
            models.setdefault(name, []).append(index)
    repeated = [name for name, owners in models.items() if len(owners) > 1]
    if repeated:
        raise InvalidRequest(f"served model names must differ, got {', '.join(map(repr, repeated))} for several "
                             "models; set --served-model-name per model (in a models file: `served_model_name`)")


class ModelRouter:
    """ASGI: shared routes answered here, everything else forwarded to the app of the request's model."""

    def __init__(self, apps: dict[str, FastAPI], settings: ServerSettings) -> None:
        self.apps, self.default = apps, next(iter(apps))
        self.named = {name: app for app in apps.values() for name in app.state.server.model_names}  # aliases too
        self.shared = _shared_app(apps)
        self.guard = RequestGuard(self._route, api_keys=settings.api_keys, max_concurrent_requests=None,
                                  max_request_body_bytes=settings.max_request_body_bytes,
                                  max_file_bytes=settings.max_file_bytes)  # fmt: skip
        self.entry = CORSMiddleware(self.guard, **settings.cors_options)  # a preflight needs no key, as one app's

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self.shared(scope, receive, send)
        await self.entry(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in SHARED_PATHS:
            return await self.shared(scope, receive, send)
        message = await receive()  # the guard hands over the whole body in one message
        body = message.get("body", b"")
        model, lora_name = _body_fields(body)
        if model is None:  # a GET names its model in the query: /debug/kv?model=b (the default app's pool otherwise)
            model = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model", [None])[0]
        if model is None and lora_name is not None and self._app_for(lora_name) is not None:
            model = lora_name  # /v1/unload_lora_adapter without `model`: the model that holds the adapter
        name = self.default if model is None else model  # "" is a name no model has, as on one model
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
        if name in self.named:
            return self.named[name]
        for app in self.apps.values():  # a LoRA adapter of one of the models
            if name in served_adapters(app.state.server.async_engine.engine):
                return app
        return None

    def _served_names(self) -> list[str]:
        names = list(self.named)
        for app in self.apps.values():
            names += served_adapters(app.state.server.async_engine.engine)
        return names


def _body_fields(body: bytes) -> tuple[str | None, str | None]:
    """The JSON body's `model` and `lora_name` (None where absent or not strings)."""
    try:
        document = json.loads(body) if body else None
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's stack
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


def build_multi_model_app(
    engines: dict, settings: ServerSettings, aliases: dict[str, tuple[str, ...]] | None = None
) -> ModelRouter:
    """The router over one single-model app per `{served name: Engine}`, each also under its `aliases` (`{served
    name: further names}`); their batch lines enter through it."""
    from paged_backend.server.app import build_app
    from paged_backend.server.batch_runner import send_lines_through

    aliases = aliases or {}
    apps = {name: build_app(engine, replace(settings, served_model_name=[name, *aliases.get(name, ())]))
            for name, engine in engines.items()}  # fmt: skip
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
        specs = [entry_spec(base, entry, f"{config_file}: models[{index}]")
                 for index, entry in enumerate(read_models_file(config_file))]  # fmt: skip
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
