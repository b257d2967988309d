"""vLLM's `SamplingParams`: how to pick tokens and when to stop, each field checked when it is made."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from paged_backend.errors import InvalidRequest
from paged_backend.structured.params import StructuredOutputsParams

GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample as argmax (as vLLM does)
# The float knobs: NaN passes no comparison and infinity overflows the logits, so each must be a finite number first
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                "typical_p", "length_penalty")  # fmt: skip
INT_FIELDS = ("n", "max_tokens", "min_tokens", "top_k")
OPTIONAL_INT_FIELDS = ("seed", "logprobs", "prompt_logprobs", "best_of", "truncate_prompt_tokens")
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
               "watermark", "detokenize", "use_beam_search")  # fmt: skip
# What beam search leaves to the model's log-probabilities alone: each of these changes sampling, which it does not do
# (temperature and seed are taken and have no effect, as in vLLM; its server ignores the rest, here they are refused).
NOT_WITH_BEAMS = ("min_tokens", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "stop", "logit_bias", "allowed_token_ids", "bad_words", "typical_p", "watermark",
                  "structured_outputs")  # fmt: skip

MAX_LENGTH_PENALTY = 10


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Field names and defaults follow vLLM.

    >>> SamplingParams(temperature=0.0, max_tokens=8).max_tokens
    8
    >>> SamplingParams(top_p=1.5)
    Traceback (most recent call last):
    paged_backend.errors.InvalidRequest: top_p must be in (0, 1], got 1.5
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per output token, besides the sampled one
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token, besides the prompt's own
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    best_of: int | None = None  # sample this many, return the n with the highest cumulative logprob
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # never generate these words (the engine tokenizes them)
    typical_p: float = 1.0
    watermark: bool = False  # TGI's green-list watermark (gamma 0.5, delta 2.0)
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens
    structured_outputs: StructuredOutputsParams | None = None
    detokenize: bool = True  # False: token ids only, no text (vLLM's; RL rollouts skip its cost)
    use_beam_search: bool = False  # n beams (engine/beam_search.py): the n best by length-penalized logprob
    length_penalty: float = 1.0  # beam score: cumulative logprob / tokens ** length_penalty

    def __post_init__(self) -> None:
        self._check_types()
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()} or None
        if isinstance(self.structured_outputs, dict):  # JSONL input and plain-dict callers
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        for name in FLOAT_FIELDS:
            if not _finite(getattr(self, name)):
                raise InvalidRequest(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if not all(map(_finite, (self.logit_bias or {}).values())):
            raise InvalidRequest(f"logit_bias values must be finite numbers, got {self.logit_bias!r}")
        checks = [
            ("n", self.n >= 1, "must be at least 1"),
            ("best_of", self.best_of is None or self.best_of >= self.n, "must be at least n"),
            ("max_tokens", self.max_tokens >= 1 or (self.max_tokens == 0 and self.prompt_logprobs is not None),
             "must be at least 1 (0 only with prompt_logprobs)"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            ("temperature", self.temperature >= 0, "must be >= 0 (0 = greedy)"),
            ("top_k", self.top_k >= -1, "must be -1, 0 (no limit) or positive"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "must be >= 0"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0, "must be >= 0"),
            ("typical_p", 0 < self.typical_p <= 1, "must be in (0, 1]"),
            # a beam's score is cumulative logprob / tokens ** length_penalty: past this it overflows or underflows
            ("length_penalty", -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY,
             f"must be in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}]"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
             "must be at least 1"),
            ("allowed_token_ids", self.allowed_token_ids is None or (
                len(self.allowed_token_ids) > 0 and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)),
             "must be a non-empty list of token ids"),
            ("bad_words", all(isinstance(w, str) and w for w in self.bad_words or []), "must be non-empty strings"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop", self.detokenize or not self.stop, "needs detokenize=True (stop strings match the text)"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "must be token ids"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise InvalidRequest(f"{name} {rule}, got {getattr(self, name)!r}")
        if self.use_beam_search:
            self._check_beam_search()

    def _check_beam_search(self) -> None:
        neutral = SamplingParams()
        changed = [name for name in NOT_WITH_BEAMS if getattr(self, name) != getattr(neutral, name)]
        if changed:
            raise InvalidRequest(f"{changed[0]} does not apply to beam search (use_beam_search=True), which ranks "
                                 f"beams by the model's log-probabilities alone; drop {changed[0]}")  # fmt: skip
        if self.best_of not in (None, self.n):
            raise InvalidRequest(f"best_of must be n or left out with beam search (n is the beam width), "
                                 f"got best_of={self.best_of} with n={self.n}")  # fmt: skip
        if self.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1 with beam search")

    def _check_types(self) -> None:
        """Each field's type, so a wrong one is named here rather than failing deep in a step (logprobs=True
        reached torch.topk mid-step) or running silently (max_tokens=2.5, ignore_eos="no")."""
        wrong = [(name, "an integer") for name in INT_FIELDS if not _is_int(getattr(self, name))]
        wrong += [(name, "an integer or None") for name in OPTIONAL_INT_FIELDS
                  if getattr(self, name) is not None and not _is_int(getattr(self, name))]  # fmt: skip
        wrong += [(name, "a number") for name in FLOAT_FIELDS
                  if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), numbers.Real)]
        wrong += [(name, "True or False") for name in BOOL_FIELDS if not isinstance(getattr(self, name), bool)]
        if not (self.stop is None or isinstance(self.stop, str) or _list_of(self.stop, str)):
            wrong.append(("stop", "a string or a list of strings"))
        for name in ("stop_token_ids", "allowed_token_ids"):
            if getattr(self, name) is not None and not _list_of(getattr(self, name), int):
                wrong.append((name, "a list of token ids"))
        if self.bad_words is not None and not _list_of(self.bad_words, str):
            wrong.append(("bad_words", "a list of strings"))
        bias = self.logit_bias
        if bias is not None and not (isinstance(bias, dict) and all(
                _is_int(key) or (isinstance(key, str) and key.isdigit()) for key in bias)):  # fmt: skip
            wrong.append(("logit_bias", "a dict of token id to bias"))
        if not isinstance(self.structured_outputs, StructuredOutputsParams | dict | None):
            wrong.append(("structured_outputs", "StructuredOutputsParams (or a dict of its fields)"))
        if wrong:
            name, kind = wrong[0]
            raise InvalidRequest(f"{name} must be {kind}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        # Below this, dividing logits by the temperature overflows; the limit of sampling is argmax anyway.
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def num_sequences(self) -> int:
        """Sequences sampled: best_of candidates when asked for, else n."""
        return max(self.n, self.best_of or 0)

    @property
    def needs_cumulative_logprob(self) -> bool:
        return self.num_sequences > self.n or self.logprobs is not None or self.use_beam_search


def _list_of(values, kind: type) -> bool:
    """A list or tuple of `kind` (ints: not bools)."""
    check = _is_int if kind is int else (lambda value: isinstance(value, kind))
    return isinstance(values, list | tuple) and all(map(check, values))


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # True is no count (logprobs=True)


def _finite(value) -> bool:
    """False for NaN and infinities only: a value of another type meets the range checks' own message."""
    return not isinstance(value, float) or math.isfinite(value)
