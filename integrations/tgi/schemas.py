"""Request bodies of TGI's HTTP API (router `GenerateRequest`, `CompatGenerateRequest`, `ChatRequest`, ...).

Every field accepts null, unknown keys are ignored, and range checks live in `validation.py` so the
messages are TGI's own.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Grammar(_Body):
    type: Literal["json", "json_object", "regex", "json_schema"]
    value: Any


class GenerateParameters(_Body):
    best_of: int | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: int | None = None
    return_full_text: bool | None = None
    stop: list[str] | None = None
    truncate: int | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    top_n_tokens: int | None = None
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


class CompatGenerateRequest(GenerateRequest):
    stream: bool = False


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class ChatRequest(_Body):
    model: str | None = None
    messages: list[ChatMessage]
    frequency_penalty: float | None = None
    logit_bias: Any = None  # accepted, unused (as in TGI)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    stop: list[str] | str | None = None
    stream: bool = False
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    tool_prompt: str | None = None
    response_format: dict[str, Any] | None = None
    stream_options: StreamOptions | None = None


class CompletionRequest(_Body):
    model: str | None = None
    prompt: str | list[str]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    seed: int | None = None
    suffix: str | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] | str | None = None
    stream_options: StreamOptions | None = None
