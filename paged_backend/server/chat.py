"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template, answers as chat objects,
with tool calls read from (or forced on) the output as the request's tool_choice says."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from paged_backend.engine.chat_template import render_chat
from paged_backend.engine.disconnect import cancel_on_disconnect
from paged_backend.engine.sampling_params import SamplingParams
from paged_backend.errors import InvalidRequest
from paged_backend.server import sse
from paged_backend.server.chat_schemas import ChatCompletionRequest
from paged_backend.server.generation import ChoiceDelta, Generation, check_streamable, output_budget
from paged_backend.server.logprobs import chat_logprobs, vllm_prompt_logprobs
from paged_backend.server.state import ServerState, server_state
from paged_backend.server.tool_parsers import StreamDelta
from paged_backend.server.tool_parsers.choice import ToolCallPlan, ToolCallReader, plan_tool_calls

router = APIRouter()

@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, server: ServerState = Depends(server_state)
) -> Response:
    lora_request = server.check_model(body.model)
    body.apply_server_defaults(server.settings.return_tokens_as_token_ids, server.settings.enable_force_include_usage)
    if body.stream and body.prompt_logprobs is not None:
        raise InvalidRequest("prompt_logprobs cannot be streamed on chat (as in vLLM); drop stream or prompt_logprobs")
    plan = tool_call_plan(server, body)
    prompt = await render_chat_prompt(server, body)
    if body.truncate_prompt_tokens is not None:
        prompt = prompt[-body.truncate_prompt_tokens :]
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = output_budget(requested, [len(prompt)], server.max_model_len, server.sampling_defaults.get("max_tokens"))
    params = chat_sampling_params(body, plan, max_tokens, server.sampling_defaults)
    check_streamable(params, body.stream, body.best_of)
    generation = Generation(server.async_engine, server.metrics, "chatcmpl", body.request_id)
    await cancel_on_disconnect(request, generation.start([prompt], params, body.priority, lora_request))
    formatter = _ChatFormatter(server, body, generation.id, plan)
    if body.stream:
        chunks = sse.event_stream(_chunks(generation, formatter, body))
        return StreamingResponse(chunks, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
    choices = await cancel_on_disconnect(request, generation.collect())
    response = formatter.envelope("chat.completion", [formatter.choice(delta) for delta in choices])
    if body.prompt_logprobs is not None:  # vLLM's field, beside the choices
        prompt_logprobs = generation.prompt_output(0).prompt_logprobs
        response["prompt_logprobs"] = vllm_prompt_logprobs(prompt_logprobs)
    response["usage"] = generation.usage().as_dict()
    return JSONResponse(response)


def tool_call_plan(server: ServerState, body: ChatCompletionRequest) -> ToolCallPlan:
    functions = {tool.function.name: tool.function.parameters for tool in body.tools or []}
    choice = body.tool_choice
    named = choice if isinstance(choice, str) or choice is None else {"name": choice.function.name}
    return plan_tool_calls(
        functions, named, body.parallel_tool_calls,
        enable_auto_tool_choice=server.settings.enable_auto_tool_choice,
        tool_call_parser=server.settings.tool_call_parser,
    )  # fmt: skip


def chat_sampling_params(
    body: ChatCompletionRequest, plan: ToolCallPlan, max_tokens: int, defaults: dict
) -> SamplingParams:
    """The request's sampling fields (`defaults` for those left out), plus what its tool_choice needs: a forced
    call's schema, or the special tokens its parser looks for.

    A forced call's schema wins over response_format (and the structured-output fields), as in vLLM: the answer is
    a call, not text, and agents send both on every turn (the OpenAI Agents SDK with an output_type and
    tool_choice="required"). The other constraint is still checked, so a malformed one is a 400 either way."""
    params = body.sampling_params(max_tokens, body.requested_logprobs(), defaults)
    if plan.structured_outputs is not None:
        params.structured_outputs = plan.structured_outputs
    if plan.keeps_special_tokens and body.skip_special_tokens is None:
        params.skip_special_tokens = False
    return params


async def render_chat_prompt(server: ServerState, body: ChatCompletionRequest) -> list[int]:
    """Token ids of the conversation as the chat template (the request's, else the model's) lays it out, on a worker
    thread: a request's own template may take a while to render, and the event loop serves everyone else."""
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    own_template = body.chat_template is not None or "chat_template" in (body.chat_template_kwargs or {})
    if own_template and not server.settings.trust_request_chat_template:  # vLLM's default since its template CVEs
        raise InvalidRequest("this request sends its own chat_template, which is code the server would run; this "
                             "server renders only its own template (start it with --trust-request-chat-template "
                             "to allow them)")  # fmt: skip
    return await asyncio.to_thread(
        render_chat, server.tokenizer, [message.for_template() for message in body.messages], tools=tools,
        documents=body.documents, chat_template=body.chat_template or server.settings.chat_template,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message, add_special_tokens=body.add_special_tokens,
        chat_template_kwargs=body.chat_template_kwargs, max_model_len=server.max_model_len,
    )  # fmt: skip


class _ChatFormatter:
    def __init__(
        self, server: ServerState, body: ChatCompletionRequest, completion_id: str, plan: ToolCallPlan
    ) -> None:
        self.tokenizer, self.body, self.id = server.tokenizer, body, completion_id
        self.model_name = server.answered_as(body.model)
        # vLLM's rule: a generation prompt is answered in --response-role; a continued message keeps its own role
        self.plan = plan
        self.role = server.settings.response_role if body.add_generation_prompt else body.response_role()
        self.created = int(time.time())
        last = body.messages[-1]
        # vLLM's echo: the answer starts with the message it continues (one in the answer's own role).
        self.echo = last.text() if body.echo and last.role == self.role else ""
        self._readers: dict[int, ToolCallReader | None] = {}  # per streamed choice

    def _logprobs(self, delta: ChoiceDelta) -> dict | None:
        if delta.logprobs is None or not self.body.logprobs:
            return None
        return chat_logprobs(
            self.tokenizer, delta.token_ids, delta.logprobs, self.body.top_logprobs or 0,
            as_token_ids=bool(self.body.return_tokens_as_token_ids),
        )  # fmt: skip

    def choice(self, delta: ChoiceDelta) -> dict:
        reader = self.plan.reader()
        message: dict = {"role": self.role, "content": self.echo + delta.text}
        finish_reason = delta.finish_reason
        if reader is not None:
            extracted = reader.extract(delta.text)
            content = (self.echo + (extracted.content or "")) or None
            message = {"role": self.role, "content": content}
            if extracted.tool_calls:
                message["tool_calls"] = [call.as_openai() for call in extracted.tool_calls]
            finish_reason = self.plan.finish_reason(delta.finish_reason, bool(extracted.tool_calls), extracted.complete)
        return {"index": delta.index, "message": message, "logprobs": self._logprobs(delta),
                "finish_reason": finish_reason}  # fmt: skip

    def chunk_choice(self, delta: ChoiceDelta) -> dict | None:
        """One choice's part of a chunk, or None when it has nothing to say yet (a parser holds text back)."""
        if delta.index not in self._readers:
            self._readers[delta.index] = self.plan.reader()
        reader = self._readers[delta.index]
        finish_reason = delta.finish_reason
        if reader is None:
            piece = StreamDelta(content=delta.text)
        else:
            piece = reader.feed(delta.text)
            if delta.finish_reason is not None:
                piece += reader.finish()
                finish_reason = self.plan.finish_reason(delta.finish_reason, reader.called, reader.complete)
        message: dict = {"role": self.role} if delta.is_first else {}
        content = (self.echo if delta.is_first else "") + piece.content
        if content or (delta.is_first and not piece.tool_calls):
            message["content"] = content
        if piece.tool_calls:
            message["tool_calls"] = [call.as_openai() for call in piece.tool_calls]
        logprobs = self._logprobs(delta)
        if not message and logprobs is None and finish_reason is None:
            return None
        return {"index": delta.index, "delta": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name, "choices": choices}


async def _chunks(
    generation: Generation, formatter: _ChatFormatter, body: ChatCompletionRequest
) -> AsyncIterator[dict]:
    async for deltas in generation.deltas():
        choices = [choice for choice in map(formatter.chunk_choice, deltas) if choice is not None]
        if choices:
            chunk = formatter.envelope("chat.completion.chunk", choices)
            if body.wants_usage_in_stream:
                # OpenAI: null on every chunk but the last; vLLM's continuous_usage_stats: the usage so far
                chunk["usage"] = generation.usage().as_dict() if body.wants_usage_on_every_chunk else None
            yield chunk
    if body.wants_usage_in_stream:
        chunk = formatter.envelope("chat.completion.chunk", [])
        chunk["usage"] = generation.usage().as_dict()
        yield chunk
