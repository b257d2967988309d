"""LoRA adapters on the OpenAI face: their `/v1/models` cards, and vLLM's runtime load / unload routes.

The routes exist only with `--allow-runtime-lora-updating` (or vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`).
An adapter is read from disk off the engine thread and registered between two steps, so stepping never
waits on a disk read.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from paged_backend.config.env import env_flag
from paged_backend.errors import InvalidRequest
from paged_backend.lora.manager import served_adapters
from paged_backend.server.openai_errors import ModelNotFound
from paged_backend.server.state import ServerState, server_state

router = APIRouter()
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(flag: bool) -> bool:
    return flag or env_flag(RUNTIME_UPDATING_ENV, False)


def adapter_cards(server: ServerState, created: int) -> list[dict]:
    """vLLM's model cards of the served adapters: `parent` is the base model, `root` the adapter's directory."""
    return [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "paged-backend",
            "root": adapter.path,
            "parent": server.model_name,
        }  # fmt: skip
        for name, adapter in served_adapters(server.async_engine.engine).items()
    ]


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)  # the `model` requests will name it by
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def _manager(server: ServerState):
    lora = server.async_engine.engine.lora
    if lora is None:
        raise InvalidRequest("LoRA is disabled on this server; start it with --enable-lora")
    return lora


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, server: ServerState = Depends(server_state)) -> str:
    lora = _manager(server)
    if body.lora_name in server.model_names or body.lora_name in lora.adapters:
        raise InvalidRequest(f"the name {body.lora_name!r} is already served; unload it first or pick another")
    adapter = await asyncio.to_thread(lora.read, lora.request_for(body.lora_name, body.lora_path))
    await server.async_engine.run_on_engine_thread(lambda: lora.register(adapter))
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, server: ServerState = Depends(server_state)) -> str:
    lora = _manager(server)
    if body.lora_name not in lora.adapters:
        raise ModelNotFound(f"The lora adapter '{body.lora_name}' cannot be found; loaded: {sorted(lora.adapters)}")
    await server.async_engine.run_on_engine_thread(lambda: lora.remove(body.lora_name))
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
