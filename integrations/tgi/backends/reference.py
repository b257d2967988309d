"""`--backend reference`: contiguous KV through HF `model.generate` (DynamicCache), one request at a time.

The A/B baseline for the paged engine: same validation, same token semantics (stopping criteria and
detokenization from `backends/tokens.py`), same raw logprobs, but none of the paging or batching.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers import StoppingCriteria as HfStoppingCriteria
from transformers.generation.streamers import BaseStreamer

from paged_backend.engine.watermark import apply_watermark
from paged_backend.tgi.backends.base import BackendEvent, BackendLoad, GeneratedToken, PrefillTokens
from paged_backend.tgi.backends.tokens import StoppingCriteria, TokenTexts, eos_token_ids
from paged_backend.tgi.http.errors import GenerationError
from paged_backend.tgi.http.metrics import TgiMetrics
from paged_backend.tgi.http.validation import ChooserParameters, ValidRequest

_END = object()


class RawLogprobs(LogitsProcessor):
    """First in the list: keeps the raw log-softmax of each step (what the paged engine reports)."""

    def __init__(self) -> None:
        self.latest: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.latest = torch.log_softmax(scores[0].float(), dim=-1)
        return scores


class FrequencyPenalty(LogitsProcessor):
    """OpenAI-style: subtract `penalty * count` for tokens already generated (not prompt tokens)."""

    def __init__(self, penalty: float, prompt_length: int) -> None:
        self.penalty, self.prompt_length = penalty, prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[0, self.prompt_length :]
        counts = torch.bincount(generated, minlength=scores.shape[-1])[: scores.shape[-1]].to(scores.dtype)
        return scores - self.penalty * counts[None, :]


class Watermark(LogitsProcessor):
    """TGI's green-list watermark through the engine's own helper, so both backends mark text identically."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        apply_watermark(scores[0], int(input_ids[0, -1]))
        return scores


def _processors(parameters: ChooserParameters, prompt_length: int, recorder: RawLogprobs) -> LogitsProcessorList:
    processors: list[LogitsProcessor] = [recorder]
    if parameters.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(parameters.repetition_penalty))
    if parameters.frequency_penalty:
        processors.append(FrequencyPenalty(parameters.frequency_penalty, prompt_length))
    if parameters.watermark:
        processors.append(Watermark())
    if parameters.do_sample:
        if parameters.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(parameters.temperature))
        if parameters.top_k:
            processors.append(TopKLogitsWarper(parameters.top_k))
        if parameters.top_p < 1.0:
            processors.append(TopPLogitsWarper(parameters.top_p))
        if parameters.typical_p < 1.0:
            processors.append(TypicalLogitsWarper(parameters.typical_p))
    return LogitsProcessorList(processors)


class _TokenStreamer(BaseStreamer):
    """Receives each new token from `generate`, applies TGI's stopping criteria, emits GeneratedToken."""

    def __init__(self, request: ValidRequest, tokenizer, eos_ids: set[int], recorder: RawLogprobs, emit) -> None:
        self.request, self.recorder, self.emit = request, recorder, emit
        self.texts = TokenTexts(tokenizer, request.input_ids)
        stopping = request.stopping
        self.stopping = StoppingCriteria(
            eos_ids, stopping.stop_sequences, stopping.max_new_tokens, stopping.ignore_eos_token
        )
        self.prompt_seen = False
        self.finished = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first hands over the prompt
            self.prompt_seen = True
            return
        token_id = int(value.reshape(-1)[0])
        logprobs = self.recorder.latest
        reason = self.stopping(token_id, self.texts.push(token_id))
        ids, values = _top(logprobs, self.request.top_n_tokens)
        self.emit(GeneratedToken(token_id, float(logprobs[token_id]), list(zip(ids, values, strict=True)), reason))
        self.finished = reason is not None

    def end(self) -> None:
        pass


def _top(logprobs: torch.Tensor, n: int) -> tuple[list[int], list[float]]:
    if not n:
        return [], []
    values, ids = logprobs.topk(n)
    return ids.tolist(), values.tolist()


class _StopWhen(HfStoppingCriteria):
    def __init__(self, done: Callable[[], bool]) -> None:
        self.done = done

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.done(), dtype=torch.bool, device=input_ids.device)


class ReferenceBackend:
    name = "reference"
    supports_prefill_logprobs = True
    supports_grammar = False  # HF generate here has no grammar engine attached

    def __init__(self, model, tokenizer, max_model_len: int) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_ids = eos_token_ids(tokenizer, getattr(model, "generation_config", None))
        self._lock = asyncio.Lock()
        self._waiting = 0

    async def start(self, metrics: TgiMetrics) -> None:
        return None

    async def shutdown(self, drain_timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._lock.acquire(), timeout=drain_timeout)

    async def health(self) -> bool:
        return True

    def load(self) -> BackendLoad:
        running = 1 if self._lock.locked() else 0
        return BackendLoad(queue_size=self._waiting, batch_size=running)

    async def generate(self, request: ValidRequest) -> AsyncIterator[BackendEvent]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def emit(event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        self._waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1
        worker = asyncio.ensure_future(asyncio.to_thread(self._run, request, emit, cancelled))
        try:
            while (event := await events.get()) is not _END:
                if isinstance(event, BaseException):
                    raise GenerationError(str(event)) from event
                yield event
        finally:
            cancelled.set()
            with contextlib.suppress(BaseException):
                await worker  # one request at a time: the model is free only once generate() returned
            self._lock.release()

    @torch.inference_mode()
    def _run(self, request: ValidRequest, emit, cancelled: threading.Event) -> None:
        try:
            self._generate(request, emit, cancelled)
        except Exception as error:  # reported to the caller as a generation error
            emit(error)
        emit(_END)

    def _generate(self, request: ValidRequest, emit, cancelled: threading.Event) -> None:
        device = self.model.device
        input_ids = torch.tensor([request.input_ids], dtype=torch.long, device=device)
        if request.decoder_input_details:
            emit(self._prefill_tokens(input_ids))
        recorder = RawLogprobs()
        streamer = _TokenStreamer(request, self.tokenizer, self.eos_ids, recorder, emit)
        parameters = request.parameters
        config = GenerationConfig(
            max_new_tokens=request.stopping.max_new_tokens,
            do_sample=parameters.do_sample,
            # Every processor is passed explicitly (in TGI's order); the config adds none of its own.
            temperature=1.0,
            top_k=None,
            top_p=1.0,
            eos_token_id=None,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        if parameters.do_sample:
            torch.manual_seed(parameters.seed)
        self.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
            logits_processor=_processors(parameters, input_ids.shape[1], recorder),
            stopping_criteria=[_StopWhen(lambda: streamer.finished or cancelled.is_set())],
            streamer=streamer,
        )

    def _prefill_tokens(self, input_ids: torch.Tensor) -> PrefillTokens:
        logprobs = torch.log_softmax(self.model(input_ids).logits[0, :-1].float(), dim=-1)
        ids = input_ids[0].tolist()
        chosen = logprobs.gather(1, input_ids[0, 1:, None])[:, 0].tolist()
        return PrefillTokens(ids=ids, logprobs=[None, *chosen])
