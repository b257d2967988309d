"""Request and sequence state and the outputs the engine returns (vLLM vocabulary); `SamplingParams` is in
`sampling_params`."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from paged_backend.engine.detokenizer import IncrementalDetokenizer
from paged_backend.engine.sampling_params import SamplingParams
from paged_backend.engine.stopping import StopRules
from paged_backend.lora.adapter import LoRAAdapter

# Class of service: "batch" runs only on capacity interactive work leaves over and is preempted first.
RequestClass = Literal["interactive", "batch"]
REQUEST_CLASSES: tuple[str, ...] = get_args(RequestClass)


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
        else:
            if self.params.num_sequences > self.params.n:
                # best_of: the n candidates with the highest cumulative logprob, renumbered 0..n-1.
                seqs = sorted(seqs, key=lambda seq: seq.cumulative_logprob, reverse=True)[: self.params.n]
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
