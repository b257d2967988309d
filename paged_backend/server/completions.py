"""POST /v1/completions: text (or token ids) in, `text_completion` objects or an SSE stream of them out.

With `echo` the prompt comes back in front of each choice's text, and with `logprobs` its tokens' logprobs too (the
first null: nothing predicts it), as evaluation harnesses read them; `max_tokens` may then be 0. vLLM's
`prompt_logprobs` field returns them in vLLM's own shape in each choice.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from paged_backend.engine.disconnect import cancel_on_disconnect
from paged_backend.engine.sampling_params import SamplingParams
from paged_backend.errors import InvalidRequest
from paged_backend.server import sse
from paged_backend.server.generation import ChoiceDelta, Generation, check_streamable, output_budget
from paged_backend.server.logprobs import completion_logprobs, joined_logprobs, vllm_prompt_logprobs
from paged_backend.server.schemas import CompletionRequest
from paged_backend.server.state import ServerState, server_state

router = APIRouter()
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@router.post("/v1/completions")
async def create_completion(
    body: CompletionRequest, request: Request, server: ServerState = Depends(server_state)
) -> Response:
    lora_request = server.check_model(body.model)
    body.apply_server_defaults(server.settings.return_tokens_as_token_ids, server.settings.enable_force_include_usage)
    prompts = [
        server.tokenizer(p, add_special_tokens=body.add_special_tokens).input_ids if isinstance(p, str) else p
        for p in body.prompts()
    ]
    if body.truncate_prompt_tokens is not None:
        prompts = [p[-body.truncate_prompt_tokens :] for p in prompts]
    if body.max_tokens == 0 and not (body.echo or body.prompt_logprobs is not None):
        raise InvalidRequest("max_tokens may be 0 only with echo or prompt_logprobs; ask for at least 1 token")
    lengths = [len(p) for p in prompts]
    max_tokens = (
        0 if body.max_tokens == 0 else output_budget(body.max_tokens, lengths, server.max_model_len,
                                                     server.sampling_defaults.get("max_tokens", DEFAULT_MAX_TOKENS))
    )  # fmt: skip
    params = completion_sampling_params(body, max_tokens, server.sampling_defaults)
    check_streamable(params, body.stream, body.best_of)
    generation = Generation(server.async_engine, server.metrics, "cmpl", body.request_id)
    await cancel_on_disconnect(request, generation.start(prompts, params, body.priority, lora_request))
    sent_as_text = [p if isinstance(p, str) and body.truncate_prompt_tokens is None else None for p in body.prompts()]
    formatter = _ChoiceFormatter(server, body, generation, sent_as_text)
    if body.stream:
        chunks = sse.event_stream(_chunks(generation, formatter, body))
        return StreamingResponse(chunks, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
    choices = await cancel_on_disconnect(request, generation.collect())
    return JSONResponse(formatter.envelope(generation.id, [formatter.choice(c) for c in choices], generation))


def completion_sampling_params(body: CompletionRequest, max_tokens: int, defaults: dict) -> SamplingParams:
    """The shared sampling fields (`defaults` for those left out), plus the prompt logprobs that echo with logprobs
    (or max_tokens 0) needs."""
    prompt_logprobs = body.prompt_logprobs
    if body.echo and (body.logprobs is not None or max_tokens == 0):
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs or 0)
    return body.sampling_params(max_tokens, body.logprobs, defaults, prompt_logprobs=prompt_logprobs)


class _ChoiceFormatter:
    """Builds choice objects; remembers each choice's text length for logprob text offsets."""

    def __init__(
        self, server: ServerState, body: CompletionRequest, generation: Generation, prompt_texts: list[str | None]
    ) -> None:
        self.tokenizer, self.model_name, self.body = server.tokenizer, server.answered_as(body.model), body
        self.generation, self.n = generation, body.n or 1
        # echo returns a text prompt as sent; token-id (or truncated) prompts come back decoded
        self.prompt_texts = prompt_texts
        self.created = int(time.time())
        self._text_length: dict[int, int] = {}

    def choice(self, delta: ChoiceDelta) -> dict:
        body, as_token_ids = self.body, bool(self.body.return_tokens_as_token_ids)
        offset = self._text_length.get(delta.index, 0)
        prompt = None
        if delta.is_first and (body.echo or body.prompt_logprobs is not None):
            prompt = self.generation.prompt_output(delta.index)
        echo_text, logprobs = "", None
        if prompt is not None and body.echo:
            echo_text = self.prompt_texts[delta.index // self.n] or self.tokenizer.decode(prompt.prompt_token_ids)
            if body.logprobs is not None:
                logprobs = completion_logprobs(
                    self.tokenizer, prompt.prompt_token_ids, prompt.prompt_logprobs, body.logprobs, offset,
                    as_token_ids=as_token_ids,
                )  # fmt: skip
        if delta.logprobs is not None and body.logprobs is not None:
            generated = completion_logprobs(
                self.tokenizer, delta.token_ids, delta.logprobs, body.logprobs, offset + len(echo_text),
                as_token_ids=as_token_ids,
            )  # fmt: skip
            logprobs = generated if logprobs is None else joined_logprobs(logprobs, generated)
        text = echo_text + delta.text
        # Offsets count token strings (as vLLM's do), so streamed pieces agree with the whole response even while
        # a token's text is held back (half a UTF-8 character).
        self._text_length[delta.index] = (
            _end_offset(logprobs) if logprobs and logprobs["tokens"] else offset + len(text)
        )
        choice = {"index": delta.index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        if body.prompt_logprobs is not None:  # vLLM's field: on a choice's first piece, null afterwards
            choice["prompt_logprobs"] = None if prompt is None else vllm_prompt_logprobs(prompt.prompt_logprobs)
        return choice

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


def _end_offset(logprobs: dict) -> int:
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


async def _chunks(generation: Generation, formatter: _ChoiceFormatter, body: CompletionRequest) -> AsyncIterator[dict]:
    async for deltas in generation.deltas():
        if deltas:
            chunk = formatter.envelope(generation.id, [formatter.choice(delta) for delta in deltas], None)
            if body.wants_usage_in_stream:
                # OpenAI: null on every chunk but the last; vLLM's continuous_usage_stats: the usage so far
                chunk["usage"] = generation.usage().as_dict() if body.wants_usage_on_every_chunk else None
            yield chunk
    if body.wants_usage_in_stream:
        yield formatter.envelope(generation.id, [], generation)
