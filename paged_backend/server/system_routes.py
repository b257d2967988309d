"""GET /health, /metrics and /v1/models."""

from __future__ import annotations

import time
from dataclasses import asdict

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from paged_backend.engine.async_engine import SLEEP_RETRY_AFTER
from paged_backend.server.lora_routes import adapter_cards
from paged_backend.server.state import ServerState, server_state
from paged_backend.worker.default_model import default_model

router = APIRouter()
STARTED = int(time.time())


@router.get("/health", responses={503: {"description": "Draining (shutting down), or asleep (sleep mode)"}})
async def health(server: ServerState = Depends(server_state)) -> JSONResponse:
    """200 while requests are accepted; 503 while draining, or asleep (with Retry-After), so a load balancer skips
    the server. The body carries the engine's counters."""
    async_engine = server.async_engine
    status = "draining" if not async_engine.accepting else "sleeping" if async_engine.sleep_level else "ok"
    body = {"status": status, "requests_in_flight": async_engine.num_in_flight, "engine": asdict(async_engine.stats())}
    headers = None
    if status == "sleeping":
        body["sleep_level"] = async_engine.sleep_level
        headers = {"Retry-After": str(SLEEP_RETRY_AFTER)}
    return JSONResponse(body, status_code=200 if status == "ok" else 503, headers=headers)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(server: ServerState = Depends(server_state)) -> Response:
    """Prometheus text exposition (vLLM's metric names)."""
    return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(server: ServerState = Depends(server_state)) -> JSONResponse:
    root = server.async_engine.engine.config.model or default_model()  # vLLM's `root`: the model as loaded
    models = [{"id": name, "object": "model", "created": STARTED, "owned_by": "paged-backend", "root": root,
               "parent": None, "max_model_len": server.max_model_len} for name in server.model_names]  # fmt: skip
    return JSONResponse({"object": "list", "data": [*models, *adapter_cards(server, STARTED)]})
