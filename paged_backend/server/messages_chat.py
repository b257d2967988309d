"""An Anthropic Messages request as the /v1/chat/completions request it means, so both render, sample and call
tools through the same code (server/chat.py) and greedy text agrees token for token.

- `system` -> a system message; text blocks -> text parts (joined as chat joins them).
- An assistant's `tool_use` blocks -> its `tool_calls` (arguments as JSON text).
- A user's `tool_result` blocks -> `tool` messages answering those calls; the turn's text blocks -> a user
  message after them (Anthropic puts the results first too).
- A conversation that ends with the assistant's turn is continued (Anthropic's prefill): no generation prompt.
- tool_choice auto | any | tool | none -> auto | required | the named function | none;
  `disable_parallel_tool_use` -> `parallel_tool_calls: false`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from paged_backend.errors import InvalidRequest
from paged_backend.server.chat_schemas import ChatCompletionRequest
from paged_backend.server.messages_schemas import (
    MessageCountTokensRequest,
    MessageParam,
    MessagesRequest,
    TextBlock,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from paged_backend.server.openai_errors import describe_validation_error

_CHAT_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


def chat_request(body: MessageCountTokensRequest) -> ChatCompletionRequest:
    """The chat-completions request for `body`; its sampling fields too when `body` is a create request."""
    continues = body.messages[-1].role == "assistant"
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": [*_system_messages(body), *(m for turn in body.messages for m in _chat_messages(turn))],
        "add_generation_prompt": not continues,
        "continue_final_message": continues,
    }
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                              "parameters": tool.input_schema}}
            for tool in body.tools
        ]  # fmt: skip
    if body.tool_choice is not None:
        choice = body.tool_choice
        if choice.type != "none" and not body.tools:  # said in Anthropic's words, not the chat request's
            raise InvalidRequest(f'tool_choice {{"type": "{choice.type}"}} needs \'tools\' to choose from; send tools '
                                 f"or drop tool_choice")  # fmt: skip
        named = isinstance(choice, ToolChoiceTool)
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}} if named else (
            _CHAT_TOOL_CHOICE[choice.type]
        )  # fmt: skip
        if getattr(choice, "disable_parallel_tool_use", None):
            fields["parallel_tool_calls"] = False
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                      stop=body.stop_sequences)  # fmt: skip
    try:
        return ChatCompletionRequest.model_validate(
            {name: value for name, value in fields.items() if value is not None}
        )
    except ValidationError as error:  # a chat rule the Messages schema does not state (distinct tool names, ...)
        raise InvalidRequest(describe_validation_error(list(error.errors()))[0]) from None


def _system_messages(body: MessageCountTokensRequest) -> list[dict]:
    if body.system is None:
        return []
    return [{"role": "system", "content": body.system if isinstance(body.system, str) else _parts(body.system)}]


def _chat_messages(turn: MessageParam) -> list[dict]:
    if isinstance(turn.content, str):
        return [{"role": turn.role, "content": turn.content}]
    blocks = turn.content
    texts = _parts([block for block in blocks if isinstance(block, TextBlock)])
    if turn.role == "assistant":
        calls = [
            {"id": block.id, "type": "function",
             "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
            for block in blocks if isinstance(block, ToolUseBlock)
        ]  # fmt: skip
        return [{"role": "assistant", "content": texts or None, **({"tool_calls": calls} if calls else {})}]
    results = [_tool_message(block) for block in blocks if isinstance(block, ToolResultBlock)]
    return [*results, *([{"role": "user", "content": texts}] if texts else [])]


def _tool_message(block: ToolResultBlock) -> dict:
    content = block.content if isinstance(block.content, str) else _parts(block.content or [])
    message = {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}
    if block.is_error:
        message["is_error"] = True  # passed to the template, which may say so
    return message


def _parts(blocks: list[TextBlock]) -> list[dict]:
    return [{"type": "text", "text": block.text} for block in blocks]
