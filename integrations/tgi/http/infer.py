"""Between the HTTP routes and a backend: admission, validation, token texts, best-of, metrics.

Mirrors TGI's router `Infer`: a permit per request (try-acquire, else 429), then a stream of tokens whose
texts come from one incremental detokenizer, whatever the backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace

from paged_backend.observability.tracing import RequestTiming, RequestTracer
from paged_backend.tgi.backends.base import Backend, FinishReason, GeneratedToken, PrefillTokens
from paged_backend.tgi.backends.tokens import TokenTexts, generated_text, token_text
from paged_backend.tgi.http.errors import IncompleteGenerationError, OverloadedError, TgiError, ValidationError
from paged_backend.tgi.http.metrics import TgiMetrics
from paged_backend.tgi.http.schemas import GenerateParameters
from paged_backend.tgi.http.settings import RouterSettings
from paged_backend.tgi.http.validation import ValidRequest, validate


@dataclass
class Token:
    id: int
    text: str
    logprob: float | None
    special: bool

    def to_json(self) -> dict:
        return {"id": self.id, "text": self.text, "logprob": self.logprob, "special": self.special}

    def to_prefill_json(self) -> dict:
        return {"id": self.id, "text": self.text, "logprob": self.logprob}


@dataclass
class StreamStep:
    """One generated token; the last one of a request also carries the finished generation."""

    index: int
    token: Token
    top_tokens: list[Token]
    generation: Generation | None = None


@dataclass
class Generation:
    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    input_length: int
    prefill: list[Token] = field(default_factory=list)
    tokens: list[Token] = field(default_factory=list)
    top_tokens: list[list[Token]] = field(default_factory=list)
    queue_time: float = 0.0
    inference_time: float = 0.0

    @property
    def logprob_sum(self) -> float:
        return sum(token.logprob or 0.0 for token in self.tokens)


class Infer:
    def __init__(
        self, backend: Backend, settings: RouterSettings, metrics: TgiMetrics, tracer: RequestTracer | None = None
    ) -> None:
        self.backend = backend
        self.tracer = tracer
        self.settings = settings
        self.metrics = metrics
        self.tokenizer = backend.tokenizer
        self.special_ids = set(getattr(self.tokenizer, "all_special_ids", []))
        self.in_flight = 0

    @contextlib.contextmanager
    def permit(self) -> Iterator[None]:
        """Hold one of `max_concurrent_requests` permits for the whole request (TGI: try_acquire, else 429)."""
        self.metrics.request_count.inc()
        if self.in_flight >= self.settings.max_concurrent_requests:
            self.metrics.request_failure.inc(err="overloaded")
            raise OverloadedError()
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def validate(self, inputs: str, params: GenerateParameters, *, add_special_tokens: bool = True) -> ValidRequest:
        start = time.monotonic()
        try:
            request = validate(inputs, params, self.tokenizer, self.settings, add_special_tokens=add_special_tokens)
            if request.decoder_input_details and not self.backend.supports_prefill_logprobs:
                raise ValidationError(
                    f"`decoder_input_details` needs prompt logprobs, which the {self.backend.name} backend does "
                    "not compute; use --backend paged, reference or grpc"
                )
            if request.parameters.grammar is not None and not self.backend.supports_grammar:
                raise ValidationError(
                    f"grammar is not supported by the {self.backend.name} backend; use --backend paged or grpc"
                )
        except ValidationError:
            self.metrics.request_failure.inc(err="validation")
            raise
        self.metrics.request_validation_duration.observe(time.monotonic() - start)
        return request

    def token(self, token_id: int, text: str, logprob: float | None) -> Token:
        return Token(token_id, text, logprob, token_id in self.special_ids)

    def _single_token(self, token_id: int, logprob: float | None) -> Token:
        return self.token(token_id, token_text(self.tokenizer, token_id), logprob)

    async def stream(self, request: ValidRequest) -> AsyncIterator[StreamStep]:
        """Tokens of one request as the backend produces them; failures count once in the metrics."""
        start = time.monotonic()
        texts = TokenTexts(self.tokenizer, request.input_ids)
        prefill: list[Token] = []
        tokens: list[Token] = []
        top_tokens: list[list[Token]] = []
        first_token_time = None
        try:
            async with contextlib.aclosing(self.backend.generate(request)) as events:
                async for event in events:
                    if isinstance(event, PrefillTokens):
                        prefill = [self._single_token(i, lp) for i, lp in zip(event.ids, event.logprobs, strict=True)]
                        continue
                    assert isinstance(event, GeneratedToken)
                    first_token_time = first_token_time or time.monotonic()
                    token = self.token(event.id, texts.push(event.id), event.logprob)
                    tops = [self._single_token(i, lp) for i, lp in event.top_tokens]
                    tokens.append(token)
                    top_tokens.append(tops)
                    step = StreamStep(len(tokens), token, tops)
                    if event.finish_reason is not None:
                        step.generation = self._finish(request, event.finish_reason, prefill, tokens, top_tokens, start)
                        # Backends do not report queueing separately: time to the first token stands in.
                        step.generation.queue_time = first_token_time - start
                        self.metrics.request_queue_duration.observe(step.generation.queue_time)
                        self._trace(request, start, first_token_time, step.generation)
                    yield step
                    if step.generation is not None:
                        return
        except TgiError as error:
            self.metrics.request_failure.inc(err=error.error_type)
            raise
        except asyncio.CancelledError:
            self.metrics.request_failure.inc(err="dropped")
            raise
        self.metrics.request_failure.inc(err="incomplete")
        raise IncompleteGenerationError("the backend ended the stream before the last token")

    def _trace(self, request: ValidRequest, start: float, first_token_time: float, generation: Generation) -> None:
        if self.tracer is None:
            return
        finish = getattr(generation.finish_reason, "value", generation.finish_reason)
        timing = RequestTiming(start, None, first_token_time, time.monotonic(), request.input_length,
                               generation.generated_tokens, [str(finish)])  # fmt: skip
        chooser = request.parameters
        options = dict(max_tokens=request.stopping.max_new_tokens, temperature=chooser.temperature,
                       top_p=chooser.top_p, top_k=chooser.top_k)  # fmt: skip
        self.tracer.record(uuid.uuid4().hex, self.settings.model_id, timing, options)

    def _finish(self, request, finish_reason, prefill, tokens, top_tokens, start) -> Generation:
        generated_ids = [token.id for token in tokens]
        elapsed = time.monotonic() - start
        self.metrics.request_success.inc()
        self.metrics.request_duration.observe(elapsed)
        self.metrics.request_inference_duration.observe(elapsed)
        self.metrics.request_mean_time_per_token_duration.observe(elapsed / max(len(tokens), 1))
        self.metrics.request_generated_tokens.observe(len(tokens))
        self.metrics.request_input_length.observe(request.input_length)
        self.metrics.request_max_new_tokens.observe(request.stopping.max_new_tokens)
        return Generation(
            generated_text=generated_text(self.tokenizer, generated_ids),
            finish_reason=finish_reason,
            generated_tokens=len(tokens),
            seed=request.parameters.seed if request.parameters.do_sample else None,
            input_length=request.input_length,
            prefill=prefill,
            tokens=list(tokens),
            top_tokens=[tops for tops in top_tokens if tops],
            inference_time=elapsed,
        )

    async def generate(self, request: ValidRequest) -> tuple[Generation, list[Generation]]:
        """The whole generation; with best_of > 1 the most likely candidate and the others."""
        if request.best_of == 1:
            return await self._collect(request), []
        candidates = [
            replace(request, parameters=replace(request.parameters, seed=random.getrandbits(64)))
            for _ in range(request.best_of)
        ]
        generations = await asyncio.gather(*(self._collect(candidate) for candidate in candidates))
        best = max(generations, key=lambda generation: generation.logprob_sum)
        return best, [generation for generation in generations if generation is not best]

    async def _collect(self, request: ValidRequest) -> Generation:
        async with contextlib.aclosing(self.stream(request)) as steps:
            async for step in steps:
                last = step
        return last.generation  # `stream` ends with the finished step or raises
