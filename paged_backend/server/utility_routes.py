"""vLLM's utility routes: POST /tokenize (a prompt, or chat messages through the chat template), POST /detokenize
and GET /version, with vLLM's request and response shapes; and, with `--enable-tokenizer-info-endpoint`, GET
/tokenizer_info (what lm-evaluation-harness's `tokenizer_backend=remote` reads before it uses the other two)."""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends
from fastapi.responses import JSONResponse
from pydantic import Field

from paged_backend import __version__
from paged_backend.errors import InvalidRequest
from paged_backend.server.chat import render_chat_prompt
from paged_backend.server.chat_schemas import ChatMessage, ChatTool
from paged_backend.server.schemas import NonEmptyStr, TokenId, _Request
from paged_backend.server.state import ServerState, server_state

router = APIRouter()
tokenizer_info_router = APIRouter()  # included only with --enable-tokenizer-info-endpoint (vLLM's default: off)
MAX_DETOKENIZE = 1 << 16
FILE_KEYS = ("vocab_file", "merges_file", "tokenizer_file")  # paths on this machine, left out as vLLM leaves them


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: NonEmptyStr
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    """Messages as /v1/chat/completions takes them; the tokens are the prompt that route would run."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes them
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE)]


TokenizeRequest = Annotated[TokenizeCompletionRequest | TokenizeChatRequest, Field(union_mode="left_to_right")]


@router.post("/tokenize")
async def tokenize(
    body: Annotated[TokenizeRequest, Body()], server: ServerState = Depends(server_state)
) -> JSONResponse:
    """Token ids of a prompt (or of chat messages rendered by the chat template), and the model's context length."""
    server.check_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        tokens = await render_chat_prompt(server, body)
    else:
        tokens = server.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
    token_strs = server.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return JSONResponse(
        {"count": len(tokens), "max_model_len": server.max_model_len, "tokens": tokens, "token_strs": token_strs}
    )


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, server: ServerState = Depends(server_state)) -> JSONResponse:
    """The text of a list of token ids."""
    server.check_model(body.model)
    vocab_size = server.async_engine.engine.vocab_size
    outside = [token for token in body.tokens if token >= vocab_size]
    if outside:
        raise InvalidRequest(f"tokens must be ids in [0, {vocab_size}); got {outside[0]}")
    return JSONResponse({"prompt": server.tokenizer.decode(body.tokens)})


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@tokenizer_info_router.get("/tokenizer_info")
async def tokenizer_info(server: ServerState = Depends(server_state)) -> JSONResponse:
    """vLLM's tokenizer info: the tokenizer's init arguments (special tokens as their text, model_max_length, ...),
    its class, and the chat template the server renders with."""
    return JSONResponse(tokenizer_config(server.tokenizer, server.settings.chat_template))


def tokenizer_config(tokenizer, chat_template: str | None = None) -> dict[str, Any]:
    """The tokenizer's configuration as JSON values (vLLM's TokenizerInfo): `init_kwargs` without file paths, special
    tokens as their text, plus `tokenizer_class` and `chat_template` (the server's, else the tokenizer's).

    >>> from paged_backend.worker.models import byte_tokenizer
    >>> info = tokenizer_config(byte_tokenizer())
    >>> info["eos_token"], info["tokenizer_class"], "chat_template" in info
    ('<|eos|>', 'TokenizersBackend', True)
    """
    config = {key: value for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if key not in FILE_KEYS}  # fmt: skip
    config = _json_value(config)
    config["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = _json_value(template)
    return config


def _json_value(value: Any) -> Any:
    """`value` as JSON can carry it: an AddedToken as its text, mappings with string keys, an infinite float or
    anything else unknown as its str()."""
    if isinstance(value, float) and not math.isfinite(value):  # JSON has no infinity
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "content"):  # tokenizers' AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(key): _json_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set):
        return [_json_value(item) for item in value]
    return str(value)
