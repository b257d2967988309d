"""The /v1/chat/completions request body: messages, tools and vLLM's chat extensions, on the shared sampling fields.

Messages take the shapes vLLM accepts, one model per role so the OpenAPI document states them: system, developer,
user, assistant (content may be null; it may carry `tool_calls`) and tool (answering a call by `tool_call_id`);
content is a string or a list of text parts (an assistant's may hold OpenAI's refusal parts too, read as their text).
Keys a message carries beyond these are passed to the chat template, as vLLM does (templates read e.g.
`reasoning_content`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from paged_backend.server.schemas import _Lenient, _SamplingRequest, fields_rule_error
from paged_backend.structured.params import checked_json_schema


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class RefusalPart(_Lenient):
    """An assistant's refusal as OpenAI returns it; sent back in a conversation, its text is the turn's content."""

    type: Literal["refusal"]
    refusal: str


Content = str | list[TextPart]
# OpenAI's assistant content parts: text and refusal
AssistantContent = str | list[Annotated[TextPart | RefusalPart, Field(discriminator="type")]]


def _part_text(part: TextPart | RefusalPart) -> str:
    return part.refusal if isinstance(part, RefusalPart) else part.text


class FunctionCall(_Lenient):
    name: Annotated[str, Field(min_length=1)]
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Message(BaseModel):
    """One turn. Keys beyond the declared ones are passed to the chat template, as vLLM does."""

    model_config = ConfigDict(extra="allow", strict=True)

    name: str | None = None

    def text(self) -> str:
        """The content as one string; parts are joined by newlines, as vLLM joins them (a refusal by its text)."""
        content = getattr(self, "content", None)
        if content is None:
            return ""
        return content if isinstance(content, str) else "\n".join(map(_part_text, content))

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: tool-call arguments as objects (templates `tojson` them)."""
        rendered: dict[str, Any] = {**(self.model_extra or {}), "role": self.role, "content": self.text()}
        if self.name is not None:
            rendered["name"] = self.name
        return rendered


class SystemMessage(_Message):
    role: Literal["system"]
    content: Content


class DeveloperMessage(_Message):
    role: Literal["developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: AssistantContent | None = None  # null when the turn only calls tools
    tool_calls: list[AssistantToolCall] | None = None

    def for_template(self) -> dict[str, Any]:
        rendered = super().for_template()
        if self.tool_calls:
            rendered["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in self.tool_calls
            ]  # fmt: skip
        return rendered


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str  # the call this result answers

    def for_template(self) -> dict[str, Any]:
        return {**super().for_template(), "tool_call_id": self.tool_call_id}


ChatMessage = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


def _arguments(text: str) -> Any:
    """Arguments as an object for the template; text that is not JSON (or nested past the parser's depth) reaches it
    as the string it is."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


class FunctionDefinition(_Lenient):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _is_a_json_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        return checked_json_schema(parameters)


class ChatTool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without (OpenAI's and vLLM's rule)
    parallel_tool_calls: bool | None = None  # default true
    # vLLM's chat extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Annotated[str, Field(min_length=1)] | None = None  # a Jinja template replacing the model's
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # passed to the template, for RAG templates that render them
    echo: bool = False  # prepend the last message's content when it has the response's role (continuing it)
    add_special_tokens: bool = False  # the template already writes them

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:  # vLLM's and OpenAI's rule: not silently ignored
            raise fields_rule_error("top_logprobs needs logprobs=true", "top_logprobs")
        return self

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[ChatTool] | None) -> list[ChatTool] | None:
        names = [tool.function.name for tool in tools or []]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"tool names must be distinct; repeated: {', '.join(repeated)}")
        return tools

    def requested_logprobs(self) -> int | None:
        """Engine logprobs count: top alternatives per token, or None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def response_role(self) -> str:
        """The role the answer speaks in: assistant, or when continuing a message, that message's role (vLLM)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role
