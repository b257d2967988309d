"""Request and sequence state, sampling parameters and the outputs the engine returns (vLLM vocabulary)."""

from __future__ import annotations

import enum
import itertools
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from paged_backend.engine.detokenizer import IncrementalDetokenizer
from paged_backend.engine.stopping import StopRules
from paged_backend.errors import InvalidRequest
from paged_backend.lora.adapter import LoRAAdapter
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

# Class of service: "batch" runs only on capacity interactive work leaves over and is preempted first.
RequestClass = Literal["interactive", "batch"]
REQUEST_CLASSES: tuple[str, ...] = get_args(RequestClass)


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


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic) of one request; a server exports these."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def record_token(self, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now


class Logprob(float):
    """A token's logprob: a float, which also carries vLLM's `Logprob` fields, so code written against vLLM's outputs
    (`entry[token].logprob`, `.rank`, `.decoded_token`) and code that reads plain floats both run unchanged."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = float.__new__(cls, logprob)
        self.rank = rank  # 1: the most likely token
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


@dataclass
class CompletionOutput:
    """One sampled completion; text and token ids are cumulative (a server computes deltas)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None  # per token: the sampled one first, then the top-k
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None  # set when logprobs are asked for or best_of > n


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # vLLM's shape: None for the first prompt token, then {token id: logprob} with the prompt token and its top-k.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (vLLM's field)


_sequence_ids = itertools.count()


class Sequence:
    """One completion being generated: its tokens, progress through the KV pool and detokenizer state."""

    def __init__(self, request: Request, index: int) -> None:
        self.seq_id = next(_sequence_ids)
        self.request = request
        self.index = index
        self.token_ids = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the pool
        self.last_scheduled_step = -1  # the scheduler's step count when it last computed this sequence
        self.status = SequenceStatus.WAITING
        self.logprobs: list[dict[int, Logprob]] | None = [] if request.params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.generator: torch.Generator | None = None  # made by the sampler for seeded requests
        self.cumulative_logprob = 0.0
        self.grammar = None  # a structured-output matcher: made by add_request, or at the fork for siblings
        self.text = ""  # detokenized output so far
        self.beam_candidates = None  # beam search: (ids, logprobs) of its likeliest next tokens, until the beams choose
        params = request.params
        self.detokenizer = IncrementalDetokenizer.after_prompt(
            self.num_prompt_tokens,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Only its latest token is left to compute (its prompt, if any was pending, is in the cache)."""
        return self.num_tokens - self.num_computed_tokens == 1

    def fork(self, index: int) -> Sequence:
        """A sibling for parallel sampling (n > 1) that shares this sequence's prompt."""
        child = Sequence(self.request, index)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        return child

    def branch(self, index: int) -> Sequence:
        """A beam that continues this one: its tokens, logprobs and progress so far (the blocks are the caller's)."""
        child = self.fork(index)
        child.token_ids = list(self.token_ids)
        child.cumulative_logprob = self.cumulative_logprob
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        return child

    def completion(self) -> CompletionOutput:
        text = self.text
        stops = self.request.params.stop
        if stops and not self.is_finished:
            # A stop string may be starting: withhold its possible prefix, which a match would cut, so the
            # cumulative text a caller sees only ever grows.
            text = text[: max(0, len(text) - max(map(len, stops)) + 1)]
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.output_token_ids,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            cumulative_logprob=self.cumulative_logprob if self.request.params.needs_cumulative_logprob else None,
        )


@dataclass(eq=False)
class Request:
    """A user request: one prompt, its sampling parameters, and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_order: int = 0
    request_class: RequestClass = "interactive"
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # the n - 1 siblings exist once the prompt is prefilled
    finished: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None  # filled while the prompt is computed
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    lora_adapter: LoRAAdapter | None = None  # the loaded adapter this request runs with; None = base model
    stop_rules: StopRules | None = None  # set by the engine's input processor
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission; None until admitted
    finished_beams: list[tuple[float, CompletionOutput]] = field(default_factory=list)  # beam search: the n best
    num_beams: int = 1  # beam search: beams made so far (each new one's index)

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def reads_prefix_cache(self) -> bool:
        """Prompt logprobs need logits at every prompt position, which a cached prefix never produced."""
        return self.prompt_logprobs is None or len(self.prompt_logprobs) >= len(self.prompt_token_ids)

    @property
    def prefix_cache_key(self) -> int | None:
        """Extra key of this request's prefix-cache blocks: KV computed under one adapter never serves another."""
        return None if self.lora_adapter is None else self.lora_adapter.load_id

    def output(self) -> RequestOutput:
        seqs = self.seqs
        if self.params.use_beam_search:  # the n best finished beams, kept best first (it reports only at its end)
            outputs = [completion for _, completion in self.finished_beams] if self.finished else []
        elif self.params.num_sequences > self.params.n:
            # best_of: the n candidates with the highest cumulative logprob, renumbered 0..n-1.
            seqs = sorted(seqs, key=lambda seq: seq.cumulative_logprob, reverse=True)[: self.params.n]
            outputs = [seq.completion() for seq in seqs]
        else:
            outputs = [seq.completion() for seq in seqs]
        for index, completion in enumerate(outputs):
            completion.index = index
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            metrics=self.metrics,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            num_cached_tokens=self.num_cached_tokens or 0,
        )
