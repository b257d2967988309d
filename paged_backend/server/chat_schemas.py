"""The /v1/chat/completions request body: messages, tools and vLLM's chat extensions, on the shared sampling fields.

Messages take the shapes vLLM accepts: roles system, developer, user, assistant (content may be null when it
carries `tool_calls`) and tool (answering a call by `tool_call_id`); content is a string or a list of text parts.
Keys a message carries beyond these are passed to the chat template, as vLLM does (templates read e.g.
`reasoning_content`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from paged_backend.server.schemas import _Lenient, _SamplingRequest


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class FunctionCall(_Lenient):
    name: Annotated[str, Field(min_length=1)]
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _shape_fits_role(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                f"a {self.role!r} message needs 'content' (only an assistant turn with tool_calls may omit it)"
            )
        for part in self.content if isinstance(self.content, list) else []:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts must be {{'type': 'text', 'text': ...}}; got type {part.type!r}")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages carry 'tool_calls', not {self.role!r} ones")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs 'tool_call_id', the id of the call it answers")
        for call in self.tool_calls or []:
            try:
                json.loads(call.function.arguments)
            except ValueError as error:
                raise ValueError(f"tool call {call.id!r}: 'function.arguments' is not JSON text ({error})") from None
        return self

    def text(self) -> str:
        """The content as one string; text parts are joined by newlines, as vLLM joins them."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: tool-call arguments as objects (templates `tojson` them)."""
        rendered: dict[str, Any] = {**(self.model_extra or {}), "role": self.role, "content": self.text()}
        if self.name is not None:
            rendered["name"] = self.name
        if self.tool_call_id is not None:
            rendered["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            rendered["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}
                for call in self.tool_calls
            ]  # fmt: skip
        return rendered


class FunctionDefinition(_Lenient):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _is_a_json_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None:
            if not isinstance(parameters.get("$schema", ""), str):  # jsonschema looks it up as a string
                raise ValueError("not a valid JSON schema: '$schema' must be a URI string")
            try:
                jsonschema.validators.validator_for(parameters).check_schema(parameters)
            except jsonschema.SchemaError as error:
                raise ValueError(f"not a valid JSON schema: {error.message}") from None
        return parameters


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
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # passed to the template, for RAG templates that render them
    echo: bool = False  # prepend the last message's content when it has the response's role (continuing it)
    add_special_tokens: bool = False  # the template already writes them

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
