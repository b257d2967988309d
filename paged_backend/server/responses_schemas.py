"""The /v1/responses request body: OpenAI's Responses fields, its input items and function tools.

`input` is a string (one user message) or a list of items: messages (system, developer, user, assistant; content
a string or input_text / output_text parts; `type` may be left out, as OpenAI's SDKs do), `function_call` and
`function_call_output`. Keys an item carries beyond these (an output item's `id`, `status`, `annotations`) are
accepted, so a client can send back what it got. Other item, part and tool types are a 400 that names them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from paged_backend.server.schemas import NonEmptyStr, Seed, _Lenient, _Request
from paged_backend.structured.params import checked_json_schema

MAX_METADATA_KEYS = 16  # OpenAI's limits on `metadata`
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
SUPPORTED_ITEMS = "message, function_call, function_call_output"


class TextContent(_Lenient):
    """A text part: input_text in what users send, output_text in what the model said."""

    type: Literal["input_text", "output_text"]
    text: str


MessageContent = str | list[TextContent]


def _only_supported(kind: str, supported: str, value: Any) -> Any:
    """A clear refusal for a `type` this server does not serve, before pydantic's generic union error."""
    if isinstance(value, dict) and isinstance(value.get("type"), str) and value["type"] not in supported.split(", "):
        raise ValueError(f"{kind} type {value['type']!r} is not supported here; use {supported}")
    return value


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: MessageContent

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        for part in content if isinstance(content, list) else []:
            _only_supported("content part", "input_text, output_text", part)
        return content

    def text(self) -> str:
        """The content as one string; parts are joined by newlines, as chat joins text parts."""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str  # JSON text


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str | list[TextContent]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(part.text for part in self.output)


def _item_kind(item: Any) -> str | None:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if kind in ("message", "function_call", "function_call_output") else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_kind,
        custom_error_type="unsupported_item",
        custom_error_message=f"an input item's type must be one of {SUPPORTED_ITEMS} (a message may leave it out)",
    ),
]


_ITEMS = TypeAdapter(list[InputItem])
_ITEM_TAGS = ("message", "function_call", "function_call_output")


def _item_error(error: ValidationError) -> PydanticCustomError:
    """The first problem of a list of items, located as `input[i].field` (pydantic's union tags left out)."""
    first = error.errors()[0]
    index, *path = first["loc"]
    path = [str(part) for part in path if part not in _ITEM_TAGS]
    where = f"input[{index}]" + "".join(f".{part}" for part in path)
    return PydanticCustomError("input_item", "{where}: {problem}", {"where": where, "problem": first["msg"]})


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: NonEmptyStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _function_tools_only(cls, tool: Any) -> Any:
        return _only_supported("tool", "function", tool)

    @field_validator("parameters")
    @classmethod
    def _is_a_json_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        return checked_json_schema(parameters)

    def for_chat(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": {key: value for key, value in function.items() if value is not None}}


class FunctionChoice(_Lenient):
    type: Literal["function"]
    name: NonEmptyStr


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def for_chat(self) -> dict[str, Any]:
        """Chat's `response_format`, which structured outputs already read."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.json_schema}}


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; a model here has no such knob


Metadata = Annotated[
    dict[str, Annotated[str, Field(max_length=MAX_METADATA_VALUE)]], Field(max_length=MAX_METADATA_KEYS)
]


class ResponsesRequest(_Request):
    model: str | None = None
    input: NonEmptyStr | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None  # a system message first; not carried over by previous_response_id
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: Metadata | None = None
    user: str | None = None
    stream: bool | None = None
    store: bool = True  # as in OpenAI: kept for GET and previous_response_id unless false
    previous_response_id: NonEmptyStr | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None  # accepted; a prompt that does not fit is a 400
    include: list[str] | None = None  # accepted; there is nothing extra to include
    # vLLM's sampling extensions, beside OpenAI's fields
    seed: Seed | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0.01, le=100)] | None = None
    ignore_eos: bool | None = None
    priority: int = 0  # lower runs first

    @field_validator("input", mode="wrap")
    @classmethod
    def _name_the_bad_item(cls, value: Any, handler: Any) -> Any:
        """A list is checked as items alone, so an error names the item rather than 'fits none of the forms'."""
        if not isinstance(value, list) or not value:
            return handler(value)
        try:
            return _ITEMS.validate_python(value)
        except ValidationError as error:
            raise _item_error(error) from None

    @field_validator("metadata")
    @classmethod
    def _short_keys(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        for key in metadata or {}:
            if len(key) > MAX_METADATA_KEY:
                raise ValueError(f"keys may have at most {MAX_METADATA_KEY} characters; {key[:20]!r}... is longer")
        return metadata

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[FunctionTool] | None) -> list[FunctionTool] | None:
        names = [tool.name for tool in tools or []]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"tool names must be distinct; repeated: {', '.join(repeated)}")
        return tools

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        """`input` as items: a string is one user message."""
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)

    def sampling_fields(self) -> dict[str, Any]:
        """The chat request fields this body's sampling fields map to (null ones left out)."""
        fields = {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "top_k": self.top_k,
                  "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                  "ignore_eos": self.ignore_eos}  # fmt: skip
        return {name: value for name, value in fields.items() if value is not None}
