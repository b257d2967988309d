"""GET /debug/kv: the KV pool block by block (`Engine.kv_snapshot`), what `paged-backend kv-map` draws.

Mounted only with `serve --enable-debug-routes`: it shows which request holds which block, which is nobody's
business on a shared server by default.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from paged_backend.server.state import ServerState, server_state

router = APIRouter()


@router.get("/debug/kv")
async def kv_pool(server: ServerState = Depends(server_state)) -> JSONResponse:
    """Every block's state, owner request, ref count, fill and group; swapped blocks; stats; recent history."""
    async_engine = server.async_engine
    return JSONResponse(await async_engine.call(async_engine.engine.kv_snapshot))
