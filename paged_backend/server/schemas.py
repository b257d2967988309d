"""OpenAI request bodies, with vLLM's extensions. Known fields are typed strictly (a wrong type is a 400 naming the
field); fields this server does not know are ignored with one warning per request, as vLLM does, unless the server
runs with `--strict-fields` (then they are a 400). docs/request-fields.md lists every field and what it does.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from paged_backend.engine.sampling_params import SamplingParams
from paged_backend.server.structured_fields import structured_outputs_params

logger = logging.getLogger(__name__)

MAX_N = 16  # choices (or best_of candidates) per prompt; bounds the work one request can ask for
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_TOKEN_LIST = 4096  # allowed_token_ids, logit_bias and bad_words entries
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # vLLM bounds `seed` to torch.long; pydantic's ints from floats stop there
GREEDY_BELOW = 1e-5  # vLLM's rule: a smaller temperature is greedy (dividing logits by it overflows)
UNKNOWN_FIELDS_ERROR = "unknown_fields"
# a rule the schema does not state (between fields, or past JSON's exact numbers): its message as written, `param`
# the field to change
FIELDS_RULE_ERROR = "fields_rule"


def fields_rule_error(message: str, param: str) -> PydanticCustomError:
    return PydanticCustomError(FIELDS_RULE_ERROR, message, {"param": param})
# Request fields that map 1:1 onto SamplingParams fields of the same name.
SAMPLING_FIELDS = (
    "n", "best_of", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "top_k", "min_p",
    "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids",
    "bad_words", "prompt_logprobs", "use_beam_search", "length_penalty",
)  # fmt: skip

# Set per request by the app (its FieldPolicy middleware): whether unknown fields are a 400 (`--strict-fields`) or a warning.
strict_fields: ContextVar[bool] = ContextVar("strict_fields", default=False)

NonEmptyStr = Annotated[str, Field(min_length=1)]


def _seed_fits(seed: int) -> int:
    """vLLM's rule: a seed fits in 64 bits. Not the schema's bounds: past 2**53 a JSON number is a float to many
    validators, which would count 2**63 + 191 as within them."""
    if not INT64_MIN <= seed <= INT64_MAX:
        raise fields_rule_error(f"seed must fit in 64 bits, from {INT64_MIN} to {INT64_MAX} (vLLM's rule)", "seed")
    return seed


Seed = Annotated[int, AfterValidator(_seed_fits)]
TokenId = Annotated[int, Field(ge=0)]
MAX_PROMPTS = 64  # prompts in one batch request
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = (
    NonEmptyStr
    | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_PROMPTS)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
)


class _Lenient(BaseModel):
    """Known keys typed strictly; unknown keys kept aside (`model_extra`) so the request can name them."""

    # NaN and Infinity (JSON extensions Python's parser takes) are refused as numbers, not compared with the bounds
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True, allow_inf_nan=False)


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk, not only the last


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Lenient):
    """vLLM's `structured_outputs` object: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the keys no model in this body declares (nested lenient objects included)."""
    names = [f"{prefix}{key}" for key in model.model_extra or {}] if isinstance(model, _Lenient) else []
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, _Lenient):
            alias = type(model).model_fields[name].alias or name
            names += unknown_fields(value, f"{prefix}{alias}.")
    return names


def _integral_floats_as_ints(value: Any) -> Any:
    """1.0 -> 1, in a value and the lists within it: JSON Schema counts 1.0 as an integer, strict pydantic not.
    Only within 64 bits, as pydantic's (and so vLLM's) ints from floats: 1e308 stays a float and is refused."""
    if isinstance(value, float) and value.is_integer() and INT64_MIN <= value <= INT64_MAX:
        return int(value)
    if isinstance(value, list):
        return [_integral_floats_as_ints(item) for item in value]
    return value


class _Request(_Lenient):
    """A request body: unknown keys anywhere in it are logged once (or refused under --strict-fields)."""

    @model_validator(mode="before")
    @classmethod
    def _json_integers(cls, body: Any) -> Any:
        if not isinstance(body, dict):
            return body
        return {key: _integral_floats_as_ints(value) for key, value in body.items()}

    @model_validator(mode="after")
    def _report_unknown_fields(self) -> _Request:
        unknown = unknown_fields(self)
        if unknown and strict_fields.get():
            names = ", ".join(f"'{name}'" for name in unknown)
            raise PydanticCustomError(
                UNKNOWN_FIELDS_ERROR,
                "unknown field {names}; remove it (this server runs with --strict-fields; see docs/request-fields.md)",
                {"names": names, "param": unknown[0]},
            )
        if unknown:
            logger.warning("ignoring request fields this server does not implement: %s", ", ".join(unknown))
        return self


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions; null means the default."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Seed | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-100, le=100)]],
            Field(max_length=MAX_TOKEN_LIST, json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"}}),
        ]
        | None
    ) = None
    user: str | None = None  # OpenAI uses it for abuse monitoring only; accepted, not needed here
    # vLLM's sampling extensions
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0.01, le=100)] | None = None  # tinier ones overflow the logits
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_STRINGS)] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKEN_LIST)] | None = None
    bad_words: Annotated[list[NonEmptyStr], Field(max_length=MAX_TOKEN_LIST)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    use_beam_search: bool | None = None  # vLLM's: n beams instead of n samples (engine/beam_search.py)
    length_penalty: Annotated[float, Field(allow_inf_nan=False)] | None = None  # beam score's length exponent
    priority: int = 0  # lower runs first, as in vLLM's priority scheduling
    request_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:N"
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted; the server's grammar engine is fixed

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:  # vLLM's rule
            raise fields_rule_error("stream_options can only be given with stream=true", "stream_options")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _keys_are_token_ids(cls, logit_bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in logit_bias or {}:
            if not key.isascii() or not key.isdigit():
                raise ValueError(f'keys must be token ids, non-negative integers written as strings (like "42"), '
                                 f"got {key!r}")
        return logit_bias

    def apply_server_defaults(self, return_tokens_as_token_ids: bool, force_include_usage: bool) -> None:
        """The server-wide defaults vLLM's flags give: `--return-tokens-as-token-ids` where the request leaves the
        field out (or null), `--enable-force-include-usage` turning a stream's `include_usage` on whatever it says
        (`continuous_usage_stats` stays the request's)."""
        if self.return_tokens_as_token_ids is None:
            self.return_tokens_as_token_ids = return_tokens_as_token_ids
        if force_include_usage and self.stream:
            self.stream_options = (self.stream_options or StreamOptions()).model_copy(update={"include_usage": True})

    @property
    def wants_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def wants_usage_on_every_chunk(self) -> bool:
        """vLLM's continuous_usage_stats: every chunk carries the usage so far (it needs include_usage too)."""
        return self.wants_usage_in_stream and self.stream_options.continuous_usage_stats

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, defaults: dict | None = None, **overrides: Any
    ) -> SamplingParams:
        """Engine parameters; fields left out or null take `defaults` (the engine's, from the generation config),
        else SamplingParams' own; `overrides` win. Beam search takes no sampling defaults (vLLM's neither): it ranks
        beams by the model's log-probabilities, and a default top_p would refuse the request."""
        defaults = {} if self.use_beam_search else defaults or {}
        given = {name: value for name, value in defaults.items() if name != "max_tokens"}  # budgeted apart
        given.update({name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None})
        given.update(overrides)
        if given.get("temperature", 1.0) < GREEDY_BELOW:
            given["temperature"] = 0.0
        if self.logit_bias:
            given["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
        return SamplingParams(
            max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured_outputs_params(self), **given
        )


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0 only with echo or prompt_logprobs: score the prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False  # the prompt (and its logprobs) come back before the completion
    add_special_tokens: bool = True  # vLLM's: text prompts get the tokenizer's special tokens (BOS)
    suffix: None = None  # OpenAI's text after the insertion: not supported, and refused as vLLM refuses it

    @field_validator("suffix", mode="before")
    @classmethod
    def _no_suffix(cls, suffix: Any) -> None:
        if suffix is not None:  # ignoring it would answer a different question than the one asked
            raise fields_rule_error("suffix is not currently supported (as in vLLM); remove it", "suffix")
        return suffix

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt of a batch: text, or token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)
