"""POST /v1/completions: text (or token ids) in, `text_completion` objects or an SSE stream of them out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from paged_backend.server import sse
from paged_backend.server.disconnect import cancel_on_disconnect
from paged_backend.server.generation import ChoiceDelta, Generation, output_budget
from paged_backend.server.logprobs import completion_logprobs
from paged_backend.server.schemas import CompletionRequest
from paged_backend.server.state import ServerState, server_state

router = APIRouter()
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@router.post("/v1/completions")
async def create_completion(
    body: CompletionRequest, request: Request, server: ServerState = Depends(server_state)
) -> Response:
    server.check_model(body.model)
    prompts = [server.tokenizer(p).input_ids if isinstance(p, str) else p for p in body.prompts()]
    max_tokens = output_budget(body.max_tokens, [len(p) for p in prompts], server.max_model_len, DEFAULT_MAX_TOKENS)
    generation = Generation(server.async_engine, server.metrics, "cmpl")
    await cancel_on_disconnect(request, generation.start(prompts, body.sampling_params(max_tokens, body.logprobs)))
    formatter = _ChoiceFormatter(server, body)
    if body.stream:
        chunks = sse.event_stream(_chunks(generation, formatter, body))
        return StreamingResponse(chunks, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
    choices = await cancel_on_disconnect(request, generation.collect())
    return JSONResponse(formatter.envelope(generation.id, [formatter.choice(c) for c in choices], generation))


class _ChoiceFormatter:
    """Builds choice objects; remembers each choice's text length for logprob text offsets."""

    def __init__(self, server: ServerState, body: CompletionRequest) -> None:
        self.tokenizer, self.model_name, self.body = server.tokenizer, server.model_name, body
        self.created = int(time.time())
        self._text_length: dict[int, int] = {}

    def choice(self, delta: ChoiceDelta) -> dict:
        offset = self._text_length.get(delta.index, 0)
        self._text_length[delta.index] = offset + len(delta.text)
        logprobs = None
        if delta.logprobs is not None and self.body.logprobs is not None:
            logprobs = completion_logprobs(self.tokenizer, delta.token_ids, delta.logprobs, self.body.logprobs, offset)
        return {"index": delta.index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason}

    def envelope(self, completion_id: str, choices: list[dict], generation: Generation | None) -> dict:
        response = {
            "id": completion_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
        }
        if generation is not None:
            response["usage"] = generation.usage().as_dict()
        return response


async def _chunks(generation: Generation, formatter: _ChoiceFormatter, body: CompletionRequest) -> AsyncIterator[dict]:
    async for deltas in generation.deltas():
        if deltas:
            chunk = formatter.envelope(generation.id, [formatter.choice(delta) for delta in deltas], None)
            if body.wants_usage_in_stream:
                chunk["usage"] = None  # OpenAI: null on every chunk but the last
            yield chunk
    if body.wants_usage_in_stream:
        yield formatter.envelope(generation.id, [], generation)
