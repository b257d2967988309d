"""The /v1/messages request bodies (Anthropic's Messages API), on the same lenient base as the OpenAI bodies.

Content is a string or a list of blocks: `text`, `tool_use` (an assistant's call) and `tool_result` (the user's
answer to one). Other block types (images, documents, thinking) are refused with a 400 that names them. Turns
start with the user; consecutive turns of one role are combined into one, as Anthropic combines them. Blocks may
carry `cache_control` (accepted and ignored: the prefix cache needs no markers).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from paged_backend.server.schemas import MAX_STOP_STRINGS, NonEmptyStr, _Lenient, _Request
from paged_backend.structured.params import checked_json_schema


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: NonEmptyStr
    name: NonEmptyStr
    input: dict[str, Any]


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text_parts(self) -> str | list[dict]:
        if self.content is None:
            return ""
        return (
            self.content if isinstance(self.content, str) else [{"type": "text", "text": b.text} for b in self.content]
        )


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]
BLOCK_TYPES = ("text", "tool_use", "tool_result")


class MessageParam(_Lenient):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]

    @field_validator("content", mode="before")
    @classmethod
    def _known_block_types(cls, content: Any) -> Any:
        """Name an unsupported block type (an image, say) instead of listing the union's mismatches."""
        for block in content if isinstance(content, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in BLOCK_TYPES:
                raise ValueError(
                    f"content blocks of type {kind!r} are not supported by this server; send "
                    f"{', '.join(BLOCK_TYPES)} blocks"
                )
        return content

    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class Tool(_Lenient):
    type: Literal["custom"] | None = None  # Anthropic's server tools (bash, web search, ...) do not run here
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any]

    @field_validator("input_schema")
    @classmethod
    def _is_an_object_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        checked_json_schema(schema)
        if schema.get("type") != "object":
            raise ValueError('a tool\'s input must be an object: give input_schema "type": "object"')
        return schema


class ToolChoiceAuto(_Lenient):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Lenient):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Lenient):
    type: Literal["tool"]
    name: NonEmptyStr
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Lenient):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]
SystemPrompt = str | list[TextBlock]


class MessageCountTokensRequest(_Request):
    """What /v1/messages/count_tokens renders: the conversation, its system prompt and tools."""

    model: NonEmptyStr
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: SystemPrompt | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: dict[str, Any] | None = None  # accepted: the prefix cache serves repeated prefixes unasked

    @field_validator("messages")
    @classmethod
    def _turns_in_order(cls, messages: list[MessageParam]) -> list[MessageParam]:
        if messages[0].role != "user":
            raise ValueError("the first message must be the user's; start the conversation with a user turn")
        turns = _combined(messages)
        calls: set[str] = set()  # the tool_use ids of the turn before
        for turn in turns:
            misplaced = {"user": "tool_use", "assistant": "tool_result"}[turn.role]
            for block in turn.blocks():
                if block.type == misplaced:
                    raise ValueError(f"{misplaced} blocks cannot be in a {turn.role} turn")
                if isinstance(block, ToolResultBlock) and block.tool_use_id not in calls:
                    raise ValueError(
                        f"tool_result {block.tool_use_id!r} answers no tool_use of the assistant turn before it; "
                        "give it the id of one of that turn's tool_use blocks"
                    )
            calls = {block.id for block in turn.blocks() if isinstance(block, ToolUseBlock)}
        if turns[-1].role == "assistant" and any(block.type == "tool_use" for block in turns[-1].blocks()):
            raise ValueError("the conversation ends with tool_use blocks; answer them in a user turn of tool_result")
        return turns


class MessagesRequest(MessageCountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: dict[str, Any] | None = None  # Anthropic's user_id for abuse monitoring; accepted, not needed here
    stream: bool | None = None


def _combined(messages: list[MessageParam]) -> list[MessageParam]:
    """Consecutive turns of one role as one turn, their blocks in order."""
    turns: list[MessageParam] = []
    for message in messages:
        if turns and turns[-1].role == message.role:
            turns[-1] = MessageParam(role=message.role, content=[*turns[-1].blocks(), *message.blocks()])
        else:
            turns.append(message)
    return turns
