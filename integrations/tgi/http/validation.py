"""TGI request validation (router `validation.rs`): same rules, same order, same messages.

The result, `ValidRequest`, is what every backend receives: token ids after truncation and the
normalized chooser / stopping parameters of TGI's `NextTokenChooserParameters` / `StoppingCriteriaParameters`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from paged_backend.errors import not_unicode
from paged_backend.tgi.http.errors import ValidationError
from paged_backend.tgi.http.grammar import ValidGrammar, validate_grammar
from paged_backend.tgi.http.schemas import GenerateParameters
from paged_backend.tgi.http.settings import RouterSettings


@dataclass(frozen=True)
class ChooserParameters:
    """How the next token is chosen; `do_sample` is the effective decision (do_sample or a warper is on)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    seed: int = 0
    watermark: bool = False
    grammar: ValidGrammar | None = None

    @property
    def warpers_active(self) -> bool:
        return self.temperature != 1.0 or self.top_k != 0 or self.top_p < 1.0 or self.typical_p < 1.0


@dataclass(frozen=True)
class StoppingParameters:
    max_new_tokens: int
    stop_sequences: tuple[str, ...] = ()
    ignore_eos_token: bool = False


@dataclass(frozen=True)
class ValidRequest:
    inputs: str
    input_ids: list[int]
    parameters: ChooserParameters
    stopping: StoppingParameters
    truncate: int | None = None
    add_special_tokens: bool = True
    top_n_tokens: int = 0
    decoder_input_details: bool = False
    # Best-of requests sample several candidates; the face keeps the most likely one.
    best_of: int = 1
    adapter_id: str | None = None  # a LoRA adapter loaded with --lora-adapters; None = the base model

    @property
    def input_length(self) -> int:
        return len(self.input_ids)


# GenerateParameters that ChooserParameters takes under the same name; one not given keeps its default ("off").
_CHOOSER_NAMES = ("temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "frequency_penalty", "watermark")


def _strictly_positive(name: str, value: float | None) -> None:
    if value is not None and not 0 < value < math.inf:  # (NaN fails it too: TGI's serde refuses it)
        raise ValidationError(f"`{name}` must be strictly positive")


def _open_unit_interval(name: str, value: float | None) -> float:
    if value is None:
        return 1.0
    if not 0.0 < value < 1.0:
        raise ValidationError(f"`{name}` must be > 0.0 and < 1.0")
    return value


def validate_parameters(params: GenerateParameters, settings: RouterSettings) -> ValidGrammar | None:
    """The checks that need no tokenizer, in the router's order; returns the normalized grammar."""
    if params.best_of is not None:
        if params.best_of < 1 or params.best_of > settings.max_best_of:
            raise ValidationError(f"`best_of` must be > 0 and <= {settings.max_best_of}. Given: {params.best_of}")
        if params.best_of > 1 and not params.is_sampling():
            raise ValidationError("you must use sampling when `best_of` is > 1")
        if params.best_of > 1 and params.seed is not None:
            raise ValidationError("`seed` must not be set when `best_of` > 1")
    _strictly_positive("temperature", params.temperature)
    _strictly_positive("repetition_penalty", params.repetition_penalty)
    if params.frequency_penalty is not None and not -2.0 <= params.frequency_penalty <= 2.0:
        raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
    _open_unit_interval("top_p", params.top_p)
    _open_unit_interval("typical_p", params.typical_p)
    _strictly_positive("top_k", params.top_k)
    _strictly_positive("max_new_tokens", params.max_new_tokens)
    stop = params.stop or []
    if len(stop) > settings.max_stop_sequences:
        raise ValidationError(f"`stop` supports up to {settings.max_stop_sequences} stop sequences. Given: {len(stop)}")
    if not all(stop):
        raise ValidationError("`stop` sequences must not be empty")  # an empty one would match at once
    top_n = params.top_n_tokens or 0
    if not 0 <= top_n <= settings.max_top_n_tokens:
        raise ValidationError(f"`top_n_tokens` must be >= 0 and <= {settings.max_top_n_tokens}. Given: {top_n}")
    if params.grammar is None:
        return None
    if settings.disable_grammar_support:
        raise ValidationError("grammar is not supported")
    return validate_grammar(params.grammar.type, params.grammar.value)


def validate_stream(params: GenerateParameters) -> None:
    """Extra rules of the streaming routes."""
    if params.best_of is not None and params.best_of != 1:
        raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
    if params.decoder_input_details:
        raise ValidationError("`decoder_input_details` == true is not supported when streaming tokens")


def check_unicode(text: str, name: str = "inputs") -> str:
    """`text`, refused if JSON gave it a lone surrogate ("\\ud800"), which no tokenizer encodes."""
    if reason := not_unicode(text):
        raise ValidationError(f"`{name}` is not valid Unicode ({reason}); send UTF-8 text")
    return text


def validate(
    inputs: str,
    params: GenerateParameters,
    tokenizer,
    settings: RouterSettings,
    *,
    add_special_tokens: bool = True,
) -> ValidRequest:
    """Check `params`, tokenize `inputs` (left-truncated to `truncate`), and check the token budget."""
    grammar = validate_parameters(params, settings)
    if not inputs:
        raise ValidationError("`inputs` cannot be empty")
    if params.truncate is not None and not 0 < params.truncate <= settings.max_input_tokens:
        raise ValidationError(
            f"`truncate` must be strictly positive and less than {settings.max_input_tokens}. Given: {params.truncate}"
        )
    input_ids = tokenizer(check_unicode(inputs), add_special_tokens=add_special_tokens).input_ids
    if params.truncate is not None:
        input_ids = input_ids[-params.truncate :]
    input_length = len(input_ids)
    max_new_tokens = params.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = max(settings.max_total_tokens - input_length, 0)
    if input_length + max_new_tokens > settings.max_total_tokens:
        raise ValidationError(
            f"`inputs` tokens + `max_new_tokens` must be <= {settings.max_total_tokens}. "
            f"Given: {input_length} `inputs` tokens and {max_new_tokens} `max_new_tokens`"
        )
    if input_length > settings.max_input_tokens:
        raise ValidationError(f"`inputs` must have less than {settings.max_input_tokens} tokens. Given: {input_length}")
    if max_new_tokens == 0:
        raise ValidationError("`max_new_tokens` must be strictly positive")
    given = {name: getattr(params, name) for name in _CHOOSER_NAMES if getattr(params, name) is not None}
    seed = params.seed if params.seed is not None else random.getrandbits(64)
    chooser = ChooserParameters(**given, seed=seed, grammar=grammar)
    chooser = replace(chooser, do_sample=params.do_sample or chooser.warpers_active)
    return ValidRequest(
        inputs=inputs,
        input_ids=list(input_ids),
        parameters=chooser,
        stopping=StoppingParameters(max_new_tokens=max_new_tokens, stop_sequences=tuple(params.stop or ())),
        truncate=params.truncate,
        add_special_tokens=add_special_tokens,
        top_n_tokens=params.top_n_tokens or 0,
        decoder_input_details=params.decoder_input_details,
        best_of=params.best_of or 1,
        adapter_id=params.adapter_id,
    )
