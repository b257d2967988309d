"""vLLM's sleep-mode routes: POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping (`engine/sleep.py` does the work).

They answer only on a server started with `--enable-sleep-mode` (404 otherwise) and, with `--api-key`, only to
the key: putting a server to sleep is an operator's act. Sleep is for an idle engine: with requests running,
/sleep answers 409 naming them and frees nothing; requests that arrive asleep get 503 with Retry-After, and so
does /health, so a load balancer skips the server until /wake_up. Sleeping deeper than now deepens the sleep,
sleeping as deep or lighter and waking an awake engine change nothing: each answers the state it leaves.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from paged_backend.engine.sleep import EngineBusy
from paged_backend.errors import InvalidRequest
from paged_backend.server.openai_errors import error_response
from paged_backend.server.openapi_document import ERROR_REF
from paged_backend.server.state import ServerState, server_state

logger = logging.getLogger(__name__)
router = APIRouter()


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": ERROR_REF}}}


ERRORS = {
    401: _error("Missing or wrong API key (when the server runs with --api-key)"),
    404: _error("Sleep mode is off: start the server with --enable-sleep-mode"),
}


def _refusal(request: Request, server: ServerState) -> JSONResponse | None:
    """The answer to a sleep route called on a server without sleep mode, else None (the guard checks the key)."""
    if not server.settings.enable_sleep_mode:
        message = f"{request.url.path} is served with sleep mode only; start the server with --enable-sleep-mode"
        return error_response(404, message, "invalid_request_error", None, "not_found")
    return None


def _state(server: ServerState) -> dict:
    level = server.async_engine.sleep_level
    return {"is_sleeping": bool(level), "level": level}


@router.post(
    "/sleep",
    responses={
        **ERRORS,
        400: _error("A level other than 1 or 2, or one this engine cannot take"),
        409: _error("Requests are still running: sleep is for an idle engine"),
    },
)
async def sleep(
    request: Request,
    level: Annotated[int, Query(ge=1, le=2, description="1: free the KV cache; 2: free the weights too")] = 1,
    server: ServerState = Depends(server_state),
) -> JSONResponse:
    """Free the KV cache (level 1), or the KV cache and the weights (level 2), until POST /wake_up."""
    if (refusal := _refusal(request, server)) is not None:
        return refusal
    try:
        await server.async_engine.sleep(level)
    except EngineBusy as error:
        return error_response(409, str(error), "invalid_request_error", None, "requests_in_flight")
    return JSONResponse(_state(server))


@router.post("/wake_up", responses={**ERRORS, 500: _error("Reloading failed; the engine is still asleep")})
async def wake_up(
    request: Request,
    tags: Annotated[
        list[str] | None, Query(description='what to bring back, "weights" and/or "kv_cache" (vLLM\'s); default: all')
    ] = None,
    server: ServerState = Depends(server_state),
) -> JSONResponse:
    """Bring the KV cache (and at level 2 the weights, loaded again from --model) back; serve again once nothing is
    left asleep."""
    if (refusal := _refusal(request, server)) is not None:
        return refusal
    try:
        await server.async_engine.wake_up(tags)
    except InvalidRequest:
        raise  # an unknown tag: the usual 400
    except Exception as error:  # a reload that failed (the model file gone): still asleep, and saying why
        logger.exception("wake_up failed")
        level = server.async_engine.sleep_level
        message = f"waking failed: {error}; the engine is still asleep at level {level}: fix that and retry /wake_up"
        return error_response(500, message, "internal_error", None, "wake_up_failed")
    return JSONResponse(_state(server))


@router.get("/is_sleeping", responses=ERRORS)
async def is_sleeping(request: Request, server: ServerState = Depends(server_state)) -> JSONResponse:
    """{"is_sleeping": bool, "level": 0 | 1 | 2}."""
    if (refusal := _refusal(request, server)) is not None:
        return refusal
    return JSONResponse(_state(server))
