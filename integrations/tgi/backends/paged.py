"""`--backend paged`: this project's continuous-batching engine in-process, through the server's AsyncEngine."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

from paged_backend.engine import Engine
from paged_backend.engine.async_engine import (
    AsyncEngine,
    EngineNotRunning,
    EngineStepFailed,
    EngineThread,
    RequestAborted,
)
from paged_backend.engine.output_processor import top_logprobs
from paged_backend.errors import InvalidRequest, PromptTooLong
from paged_backend.tgi.backends.base import BackendEvent, BackendLoad, GeneratedToken, PrefillTokens
from paged_backend.tgi.backends.lora import lora_request
from paged_backend.tgi.backends.sampling import finish_reason, sampling_params
from paged_backend.tgi.http.errors import GenerationError, OverloadedError, ValidationError
from paged_backend.tgi.http.metrics import TgiMetrics
from paged_backend.tgi.http.validation import ValidRequest


class PagedBackend:
    name = "paged"
    supports_prefill_logprobs = True  # SamplingParams.prompt_logprobs
    supports_grammar = True

    def __init__(self, engine: Engine, engine_thread: EngineThread | None = None) -> None:
        self.async_engine = AsyncEngine(engine, engine_thread)
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._request_ids = itertools.count()
        self.model_id = engine.config.model
        self._running = False

    async def start(self, metrics: TgiMetrics) -> None:
        from paged_backend.observability.metrics import EngineStatsCollector

        metrics.registry.register(EngineStatsCollector(self.async_engine))  # the engine's own counters, next to TGI's
        await self.async_engine.start()
        self._running = True

    async def shutdown(self, drain_timeout: float) -> None:
        self._running = False
        await self.async_engine.shutdown(drain_timeout)

    async def health(self) -> bool:
        return self._running

    def load(self) -> BackendLoad:
        stats = self.async_engine.stats()
        manager = self.async_engine.engine.block_manager
        capacity = (manager.num_blocks - 1) * manager.block_size
        return BackendLoad(
            queue_size=stats.num_waiting,
            batch_size=stats.num_running,
            kv_tokens_used=round(stats.kv_usage * capacity),
            kv_tokens_total=capacity,
        )

    async def generate(self, request: ValidRequest) -> AsyncIterator[BackendEvent]:
        params = sampling_params(
            request.parameters, request.stopping, request.top_n_tokens, prefill_logprobs=request.decoder_input_details
        )
        request_id = f"tgi-{next(self._request_ids)}"
        lora = lora_request(self.async_engine.engine, request.adapter_id, self.model_id)
        outputs = self.async_engine.generate(
            request_id, sampling_params=params, prompt_token_ids=request.input_ids, lora_request=lora
        )
        num_sent = 0
        prefill_pending = request.decoder_input_details
        try:
            async for output in outputs:
                if prefill_pending and len(output.prompt_logprobs or ()) >= len(output.prompt_token_ids):
                    prefill_pending = False  # complete once the whole prompt was computed (chunks come earlier)
                    yield prefill_tokens(output.prompt_token_ids, output.prompt_logprobs)
                completion = output.outputs[0]
                if completion.finish_reason == "abort":
                    raise GenerationError(f"request {request_id} was aborted by the engine")
                last = len(completion.token_ids) - 1
                for position in range(num_sent, last + 1):
                    token_id = completion.token_ids[position]
                    logprobs = completion.logprobs[position]
                    done = output.finished and position == last
                    yield GeneratedToken(
                        id=token_id,
                        logprob=logprobs[token_id],
                        top_tokens=top_logprobs(logprobs, request.top_n_tokens),
                        finish_reason=self._finish_reason(completion, request) if done else None,
                    )
                num_sent = last + 1
        except (InvalidRequest, PromptTooLong) as error:
            # Everything else was checked by the face already, so the engine can only object to the grammar.
            prefix = "grammar is not valid: " if request.parameters.grammar is not None else ""
            raise ValidationError(f"{prefix}{error}") from error
        except ImportError as error:  # the structured-output engine (the `structured` extra) is missing
            raise ValidationError(f"grammar is not supported: {error}") from error
        except EngineNotRunning as error:
            raise OverloadedError(str(error)) from error
        except (EngineStepFailed, RequestAborted) as error:
            raise GenerationError(str(error)) from error
        finally:
            await outputs.aclose()

    @staticmethod
    def _finish_reason(completion, request: ValidRequest):
        # TGI checks the length limit before EOS, so a last token that is also EOS still ends with `length`.
        if len(completion.token_ids) >= request.stopping.max_new_tokens:
            return "length"
        return finish_reason(completion.finish_reason, completion.stop_reason)


def prefill_tokens(prompt_token_ids: list[int], prompt_logprobs: list[dict[int, float] | None]) -> PrefillTokens:
    """The engine's prompt logprobs (vLLM's list: None, then {token: logprob, ...}) as TGI's prefill tokens."""
    logprobs = [
        None if entry is None else entry[token] for token, entry in zip(prompt_token_ids, prompt_logprobs, strict=True)
    ]
    return PrefillTokens(ids=list(prompt_token_ids), logprobs=logprobs)
