"""A Responses request as the chat request it means, so the prompt renders exactly as /v1/chat/completions does.

Items map onto chat messages one to one: a message item is a message of its role, consecutive function_call items
are one assistant turn's `tool_calls` (joined to the assistant message right before them, as chat writes a turn
that says something and calls tools), and a function_call_output is a `tool` message answering its call_id.
`instructions` come first as a system message. A turn whose tool_choice forces a call leaves `text.format` for
the turns that answer in text (as OpenAI does; an agent sends both on every turn).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from paged_backend.errors import InvalidRequest
from paged_backend.server.chat_schemas import ChatCompletionRequest
from paged_backend.server.responses_schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
)
from paged_backend.server.structured_fields import checked_schema

Item = MessageItem | FunctionCallItem | FunctionCallOutputItem


def chat_messages(items: list[Item], instructions: str | None, first_new: int = 0) -> list[dict[str, Any]]:
    """Chat messages for `items`; `first_new` is where the request's own input starts (earlier items come from
    previous_response_id), so an error names the request's item as `input[i]`."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    called: set[str] = set()
    for position, item in enumerate(items):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            called.add(item.call_id)
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            if item.call_id not in called:
                where = f"input[{position - first_new}]" if position >= first_new else "the stored conversation"
                raise InvalidRequest(
                    f"{where}: function_call_output answers call_id {item.call_id!r}, but no function_call before "
                    "it has that call_id; send the function_call item first (or continue with previous_response_id)"
                )
            messages.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
    return messages


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request whose prompt, tool plan and sampling this Responses request shares."""
    fields: dict[str, Any] = {"messages": messages, **body.sampling_fields()}
    if body.max_output_tokens is not None:
        fields["max_completion_tokens"] = body.max_output_tokens
    if body.tools:
        fields["tools"] = [tool.for_chat() for tool in body.tools]
    if body.tool_choice is not None:
        choice = body.tool_choice
        fields["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    text_format = body.text.format if body.text is not None else None
    # A forced call is not text: OpenAI applies text.format to the turns that answer in text, so it waits.
    forced = body.tool_choice is not None and body.tool_choice not in ("auto", "none")
    if text_format is not None and text_format.type == "json_schema":
        if text_format.json_schema is None:
            raise InvalidRequest('text.format {"type": "json_schema"} needs "schema": {...} (and a "name")')
        checked_schema("text.format.schema", text_format.json_schema)  # named as sent, even on a turn it waits
    if text_format is not None and not forced:
        fields["response_format"] = text_format.for_chat()
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:  # every field was checked already; a miss here is still the request's
        raise InvalidRequest(f"the request cannot be read as a conversation: {error.errors()[0]['msg']}") from None
