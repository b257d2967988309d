"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template, answers as chat objects."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError

from paged_backend.errors import InvalidRequest
from paged_backend.server import sse
from paged_backend.server.disconnect import cancel_on_disconnect
from paged_backend.server.generation import ChoiceDelta, Generation, output_budget
from paged_backend.server.logprobs import chat_logprobs
from paged_backend.server.chat_schemas import ChatCompletionRequest
from paged_backend.server.state import ServerState, server_state

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, server: ServerState = Depends(server_state)
) -> Response:
    server.check_model(body.model)
    prompt = render_chat_prompt(server, body)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = output_budget(requested, [len(prompt)], server.max_model_len, default=None)
    generation = Generation(server.async_engine, server.metrics, "chatcmpl")
    params = body.sampling_params(max_tokens, body.requested_logprobs())
    await cancel_on_disconnect(request, generation.start([prompt], params))
    formatter = _ChatFormatter(server, body, generation.id)
    if body.stream:
        chunks = sse.event_stream(_chunks(generation, formatter, body))
        return StreamingResponse(chunks, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
    choices = await cancel_on_disconnect(request, generation.collect())
    response = formatter.envelope("chat.completion", [formatter.choice(delta) for delta in choices])
    response["usage"] = generation.usage().as_dict()
    return JSONResponse(response)


def render_chat_prompt(server: ServerState, body: ChatCompletionRequest) -> list[int]:
    """Token ids of the conversation as the model's chat template lays it out."""
    tokenizer = server.tokenizer
    if not tokenizer.chat_template:
        raise InvalidRequest("this model's tokenizer has no chat template; use /v1/completions instead")
    messages = [{"role": message.role, "content": message.text()} for message in body.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, tokenize=False)
    except TemplateError as error:  # templates reject some conversations (e.g. roles that do not alternate)
        raise InvalidRequest(f"the chat template rejected these messages: {error}") from error
    return tokenizer(text, add_special_tokens=False).input_ids


class _ChatFormatter:
    def __init__(self, server: ServerState, body: ChatCompletionRequest, completion_id: str) -> None:
        self.tokenizer, self.model_name, self.body, self.id = server.tokenizer, server.model_name, body, completion_id
        self.created = int(time.time())

    def _logprobs(self, delta: ChoiceDelta) -> dict | None:
        if delta.logprobs is None or not self.body.logprobs:
            return None
        return chat_logprobs(self.tokenizer, delta.token_ids, delta.logprobs, self.body.top_logprobs or 0)

    def choice(self, delta: ChoiceDelta) -> dict:
        message = {"role": "assistant", "content": delta.text}
        return {"index": delta.index, "message": message, "logprobs": self._logprobs(delta),
                "finish_reason": delta.finish_reason}  # fmt: skip

    def chunk_choice(self, delta: ChoiceDelta) -> dict:
        content = {"role": "assistant", "content": delta.text} if delta.is_first else {"content": delta.text}
        return {"index": delta.index, "delta": content, "logprobs": self._logprobs(delta),
                "finish_reason": delta.finish_reason}  # fmt: skip

    def envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name, "choices": choices}


async def _chunks(
    generation: Generation, formatter: _ChatFormatter, body: ChatCompletionRequest
) -> AsyncIterator[dict]:
    async for deltas in generation.deltas():
        if deltas:
            chunk = formatter.envelope("chat.completion.chunk", [formatter.chunk_choice(d) for d in deltas])
            if body.wants_usage_in_stream:
                chunk["usage"] = None  # OpenAI: null on every chunk but the last
            yield chunk
    if body.wants_usage_in_stream:
        chunk = formatter.envelope("chat.completion.chunk", [])
        chunk["usage"] = generation.usage().as_dict()
        yield chunk
