"""OpenAI request bodies. Strict: wrong types and unknown fields are rejected with a 400 naming the field.

Besides OpenAI's fields, the vLLM sampling extensions (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, skip_special_tokens) are accepted. `user` is accepted and ignored, as OpenAI
only uses it for abuse monitoring. OpenAI fields this server does not implement (echo, suffix, best_of,
logit_bias, response_format, tools, ...) are rejected like unknown ones, so no client silently gets
behaviour other than what it asked for.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from paged_backend.engine.request import SamplingParams

MAX_N = 16  # choices per prompt; bounds the work one request can ask for
MAX_STOP_STRINGS = 16
GREEDY_BELOW = 1e-5  # vLLM's rule: a smaller temperature is greedy (dividing logits by it overflows)

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
MAX_PROMPTS = 64  # prompts in one batch request
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = (
    str
    | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions; null means the default."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    user: str | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0.01, le=100)] | None = None  # tinier ones overflow the logits
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_STRINGS)] | None = None
    skip_special_tokens: bool | None = None

    @property
    def wants_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Engine parameters; fields left out or null keep SamplingParams' own defaults."""
        given = {
            name: getattr(self, name)
            for name in (
                "n",
                "temperature",
                "top_p",
                "seed",
                "stop",
                "presence_penalty",
                "frequency_penalty",
                "top_k",
                "min_p",
                "repetition_penalty",
                "min_tokens",
                "ignore_eos",
                "stop_token_ids",
                "skip_special_tokens",
            )  # fmt: skip
            if getattr(self, name) is not None
        }
        if given.get("temperature", 1.0) < GREEDY_BELOW:
            given["temperature"] = 0.0
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **given)


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt of a batch: text, or token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)
