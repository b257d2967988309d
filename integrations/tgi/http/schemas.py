"""Request bodies of TGI's HTTP API (router `GenerateRequest`, `CompatGenerateRequest`, `ChatRequest`, ...).

Every field accepts null, unknown keys are ignored, types are strict (no "1" for 1, as serde), and range checks
live in `http/validation.py` so the messages are TGI's own (`http/openapi.py` declares those ranges in the document).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


def _whole_number(value: Any) -> Any:
    """JSON Schema counts 3.0 as an integer, so the document's `integer` fields take it (never "3" or 3.5)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_whole_number)]
# TGI's Rust integer types bound what deserializes at all (anything larger is a 422 before validation).
def U32():  # noqa: N802 - reads as the Rust type it mirrors
    return Field(None, le=2**32 - 1)


def I32():  # noqa: N802
    return Field(None, le=2**31 - 1)


def _u64(value: int) -> int:
    if not 0 <= value <= 2**64 - 1:  # written out: pydantic prints a bound this large rounded through a float
        raise PydanticCustomError("u64", f"Input should be between 0 and {2**64 - 1} (a u64)")
    return value


U64 = Annotated[int, BeforeValidator(_whole_number), AfterValidator(_u64)]


class Grammar(_Body):
    type: Literal["json", "json_object", "regex", "json_schema"]
    value: Any


class GenerateParameters(_Body):
    best_of: Int | None = U32()
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: Int | None = I32()
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: Int | None = U32()
    return_full_text: bool | None = None
    stop: list[str] | None = None
    truncate: Int | None = U32()
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: U64 | None = None
    top_n_tokens: Int | None = U32()
    grammar: Grammar | None = None
    adapter_id: str | None = None

    def is_sampling(self) -> bool:
        """TGI samples iff do_sample is set or any warper is requested (best_of rule, NextTokenChooser)."""
        warpers = (self.temperature, self.top_k, self.top_p, self.typical_p)
        return self.do_sample or any(value is not None for value in warpers)


def parameters_when_absent() -> GenerateParameters:
    """TGI quirk kept for parity: a body without a "parameters" key samples (router `default_parameters`)."""
    return GenerateParameters(do_sample=True)


class GenerateRequest(_Body):
    inputs: str
    parameters: GenerateParameters = Field(default_factory=parameters_when_absent)


class TokenizeRequest(_Body):
    """`/tokenize` reads only `inputs`; `parameters` is accepted and unused."""

    inputs: str
    parameters: dict[str, Any] | None = None


class CompatGenerateRequest(GenerateRequest):
    stream: bool = False


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class ResponseFormat(_Body):
    """OpenAI's (text | json_object | json_schema with `json_schema`) or TGI's (json | regex with `value`)."""

    type: Literal["text", "json_object", "json_schema", "json", "regex"]
    value: Any = None
    json_schema: dict[str, Any] | None = None


class ChatRequest(_Body):
    model: str | None = None
    messages: list[ChatMessage]
    frequency_penalty: float | None = None
    logit_bias: Any = None  # accepted, unused (as in TGI)
    logprobs: bool | None = None
    top_logprobs: Int | None = U32()
    max_tokens: Int | None = U32()
    max_completion_tokens: Int | None = U32()
    n: Int | None = U32()
    presence_penalty: float | None = None
    stop: list[str] | str | None = None
    stream: bool = False
    seed: U64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    tool_prompt: str | None = None
    response_format: ResponseFormat | None = None
    stream_options: StreamOptions | None = None


class CompletionRequest(_Body):
    model: str | None = None
    prompt: str | list[str]
    max_tokens: Int | None = U32()
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    seed: U64 | None = None
    suffix: str | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] | str | None = None
    stream_options: StreamOptions | None = None
