"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat-completions path.

A request becomes the chat request it means (server/messages_chat.py), rendered, sampled and tool-called by
server/chat.py's code, so greedy text equals /v1/chat/completions' for the same conversation. The answer is a
`message`: text and `tool_use` content blocks, Anthropic's stop reasons, and usage in Anthropic's terms: the
prompt tokens served from the prefix cache are `cache_read_input_tokens` and not part of `input_tokens` (their
sum is what count_tokens says). Errors under /v1/messages come in Anthropic's shape (server/openai_errors.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pydantic_core
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from paged_backend.engine.disconnect import cancel_on_disconnect
from paged_backend.server import sse
from paged_backend.server.chat import chat_sampling_params, render_chat_prompt, tool_call_plan
from paged_backend.server.generation import ChoiceDelta, Generation, Usage, output_budget
from paged_backend.server.messages_chat import chat_request
from paged_backend.server.messages_events import ContentBlocks, event_stream, new_tool_use_id
from paged_backend.server.messages_schemas import MessageCountTokensRequest, MessagesRequest
from paged_backend.server.state import ServerState, server_state
from paged_backend.server.tool_parsers import StreamDelta
from paged_backend.server.tool_parsers.choice import ToolCallPlan

router = APIRouter()


@router.post("/v1/messages")
async def create_message(
    body: MessagesRequest, request: Request, server: ServerState = Depends(server_state)
) -> Response:
    lora_request = server.check_model(body.model)
    chat = chat_request(body)
    plan = tool_call_plan(server, chat)
    prompt = await render_chat_prompt(server, chat)
    max_tokens = output_budget(body.max_tokens, [len(prompt)], server.max_model_len, default=None)  # required here
    generation = Generation(server.async_engine, server.metrics, "msg")
    params = chat_sampling_params(chat, plan, max_tokens, server.sampling_defaults)
    await cancel_on_disconnect(request, generation.start([prompt], params, chat.priority, lora_request))
    message = _Message(body, plan, generation)
    if body.stream:
        return StreamingResponse(event_stream(message.events()), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
    [choice] = await cancel_on_disconnect(request, generation.collect())
    return JSONResponse(message.whole(choice))


@router.post("/v1/messages/count_tokens")
async def count_message_tokens(body: MessageCountTokensRequest, server: ServerState = Depends(server_state)) -> dict:
    """The prompt tokens a create with this conversation, system prompt and tools would send to the model."""
    server.check_model(body.model)
    return {"input_tokens": len(await render_chat_prompt(server, chat_request(body)))}


def anthropic_usage(usage: Usage) -> dict:
    """Anthropic counts cache reads apart from `input_tokens`; the prefix cache is filled without being asked, so
    nothing counts as a cache write."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


class _Message:
    """One answer, as a whole `message` object or as the events that stream it."""

    def __init__(self, body: MessagesRequest, plan: ToolCallPlan, generation: Generation) -> None:
        self.body, self.plan, self.generation = body, plan, generation
        self.id = "msg_" + generation.id.removeprefix("msg-")

    def envelope(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.body.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": anthropic_usage(self.generation.usage())}  # fmt: skip

    def whole(self, choice: ChoiceDelta) -> dict:
        content, called = _content_blocks(choice.text, self.plan)
        return self.envelope(content, *self._stop(choice.finish_reason, called))

    async def events(self) -> AsyncIterator[dict]:
        blocks, reader, started = ContentBlocks(), self.plan.reader(), False
        async for deltas in self.generation.deltas():
            if not started:  # the first outputs are in: the prompt's cache hits are known
                yield {"type": "message_start", "message": self.envelope([], None, None)}
                yield {"type": "ping"}
                started = True
            for delta in deltas:
                piece = StreamDelta(content=delta.text) if reader is None else reader.feed(delta.text)
                if delta.finish_reason is not None and reader is not None:
                    piece += reader.finish()
                events = blocks.events(piece)
                if delta.finish_reason is not None:
                    called = reader is not None and reader.called and reader.complete
                    events += [
                        *blocks.close(),
                        self._message_delta(delta.finish_reason, called),
                        {"type": "message_stop"},
                    ]
                for event in events:
                    yield event

    def _message_delta(self, finish_reason: str, called: bool) -> dict:
        stop_reason, stop_sequence = self._stop(finish_reason, called)
        return {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": anthropic_usage(self.generation.usage())}  # fmt: skip

    def _stop(self, finish_reason: str | None, called: bool) -> tuple[str, str | None]:
        """Anthropic's stop_reason and stop_sequence for the engine's finish."""
        if finish_reason == "length":
            return "max_tokens", None
        if called:
            return "tool_use", None
        matched = self.generation.prompt_output(0).outputs[0].stop_reason
        if isinstance(matched, str) and matched in (self.body.stop_sequences or []):
            return "stop_sequence", matched
        return "end_turn", None


def _content_blocks(text: str, plan: ToolCallPlan) -> tuple[list[dict], bool]:
    """Text and tool_use blocks of a whole output, and whether it made whole calls. A call cut off by max_tokens
    is still a tool_use block, as the stream sends it; its input is what the SDK builds from the streamed
    `partial_json` (the arguments read as partial JSON: an unfinished key or string left out)."""
    reader = plan.reader()
    extracted = None if reader is None else reader.extract(text)
    if extracted is None or not extracted.tool_calls:
        return ([{"type": "text", "text": text}] if text else []), False
    content = [{"type": "text", "text": extracted.content}] if extracted.content else []
    content += [
        {"type": "tool_use", "id": new_tool_use_id(), "name": call.name, "input": _tool_input(call.arguments)}
        for call in extracted.tool_calls
    ]
    return content, extracted.complete


def _tool_input(arguments: str) -> dict:
    """The arguments as an object, read as far as they go (pydantic's partial JSON reader is jiter's, which the
    anthropic SDK uses for streamed input); anything but an object is {}."""
    try:
        value = pydantic_core.from_json(arguments, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
