"""One OpenAI call as engine work: a request per prompt, merged into per-choice deltas of cumulative outputs.

Choice `i` of prompt `p` is choice `p * n + i` of the response, as in OpenAI's batch completions.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass

from paged_backend.engine.async_engine import AsyncEngine
from paged_backend.engine.request import CompletionOutput, RequestOutput
from paged_backend.engine.sampling_params import SamplingParams
from paged_backend.errors import InvalidRequest, PromptTooLong
from paged_backend.observability.metrics import ServerMetrics
from paged_backend.server.request_class import REQUEST_CLASS


def output_budget(requested: int | None, prompt_lengths: list[int], max_model_len: int, default: int | None) -> int:
    """max_tokens for the engine: the request's, checked against the context; else the default, clipped to fit.

    >>> output_budget(None, [10], 64, 16), output_budget(None, [60], 64, 16), output_budget(None, [10], 64, None)
    (16, 4, 54)
    """
    room = max_model_len - max(prompt_lengths)
    if room < 1:
        raise PromptTooLong(
            f"the prompt has {max(prompt_lengths)} tokens but this model's context is {max_model_len} tokens, "
            "which leaves no room for output; shorten the prompt"
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise PromptTooLong(
            f"this model's context is {max_model_len} tokens, but {max(prompt_lengths)} prompt tokens plus "
            f"max_tokens={requested} would need {max(prompt_lengths) + requested}; lower max_tokens or shorten the prompt"
        )
    return requested


@dataclass
class ChoiceDelta:
    """What one choice gained since the previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    is_first: bool


@dataclass
class _ChoiceProgress:
    text_sent: int = 0
    tokens_sent: int = 0
    started: bool = False
    finished: bool = False


# Set per request by the app (its FieldPolicy middleware) from `--enable-prompt-tokens-details`: whether chat and
# completions usage carries prompt_tokens_details (vLLM's flag; off by default, as in vLLM).
prompt_tokens_details: ContextVar[bool] = ContextVar("prompt_tokens_details", default=False)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (Responses and Messages report them)

    def as_dict(self) -> dict:
        """OpenAI's usage object; with `--enable-prompt-tokens-details`, also the prefix-cache hit as
        `prompt_tokens_details.cached_tokens`."""
        total = self.prompt_tokens + self.completion_tokens
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": total}  # fmt: skip
        if prompt_tokens_details.get():
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


def check_streamable(params: SamplingParams, stream: bool | None, best_of: int | None) -> None:
    """best_of candidates beyond n cannot be streamed: which n are best is known only at the end."""
    if stream and params.num_sequences > params.n:
        raise InvalidRequest(
            f"best_of={best_of} cannot be streamed: the best {params.n} are known only at the end; "
            "drop stream or set best_of to n"
        )


class Generation:
    """Runs the engine requests of one API call and turns their outputs into choice deltas."""

    def __init__(
        self, async_engine: AsyncEngine, metrics: ServerMetrics, id_prefix: str, request_id: str | None = None
    ) -> None:
        self.async_engine, self.metrics = async_engine, metrics
        self.id = f"{id_prefix}-{request_id or uuid.uuid4().hex}"  # vLLM: the client's request_id names the response
        self._engine_id = uuid.uuid4().hex  # engine ids stay unique even when two clients send one request_id
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._first_outputs: list[RequestOutput] = []
        self._progress: dict[int, _ChoiceProgress] = {}
        self._final: dict[int, RequestOutput] = {}
        self._n = 1

    async def start(
        self, prompts: list[str | list[int]], params: SamplingParams, priority: int = 0, lora_request=None
    ) -> None:
        """Add every prompt and wait for its first output, so bad input fails before any response byte.

        The requests run in the class of service the caller set (`REQUEST_CLASS`: the batch API's are "batch")."""
        self._n = params.n
        request_class = REQUEST_CLASS.get()
        self.metrics.requests_by_class.labels(request_class).inc(len(prompts))
        for index, prompt in enumerate(prompts):
            text, token_ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            stream = self.async_engine.generate(
                f"{self.id}-{index}-{self._engine_id}",
                text,
                params,
                prompt_token_ids=token_ids,
                priority=priority,
                lora_request=lora_request,
                request_class=request_class,
            )
            self._streams.append(self.metrics.track(stream, params))
        firsts = [asyncio.ensure_future(anext(stream)) for stream in self._streams]
        try:
            self._first_outputs = list(await asyncio.gather(*firsts))
        except BaseException:  # one prompt failed or the client left: abort the others too
            for first in firsts:
                first.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            await self.close()
            raise

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Deltas per engine output (first outputs included); closes the engine requests when done or dropped."""
        try:
            for prompt_index, output in enumerate(self._first_outputs):
                yield self._deltas_of(prompt_index, output)
            async for prompt_index, output in _merge(self._streams):
                yield self._deltas_of(prompt_index, output)
        finally:
            await self.close()

    async def collect(self) -> list[ChoiceDelta]:
        """Run to the end; one merged delta per choice, in choice order."""
        merged: dict[int, ChoiceDelta] = {}
        async for deltas in self.deltas():
            for delta in deltas:
                total = merged.setdefault(delta.index, ChoiceDelta(delta.index, "", [], None, None, True))
                total.text += delta.text
                total.token_ids += delta.token_ids
                if delta.logprobs is not None:
                    total.logprobs = (total.logprobs or []) + delta.logprobs
                total.finish_reason = delta.finish_reason
        return [merged[index] for index in sorted(merged)]

    async def close(self) -> None:
        """Abort whatever is still running (closing an engine stream early aborts its request)."""
        for stream in self._streams:
            await stream.aclose()

    def usage(self) -> Usage:
        usage = Usage()
        for output in self._final.values():
            usage.prompt_tokens += len(output.prompt_token_ids)
            usage.cached_tokens += output.num_cached_tokens
            usage.completion_tokens += sum(len(completion.token_ids) for completion in output.outputs)
        return usage

    def prompt_output(self, choice_index: int) -> RequestOutput:
        """The latest engine output of the prompt a choice belongs to (its prompt ids and prompt logprobs)."""
        return self._final[choice_index // self._n]

    def _deltas_of(self, prompt_index: int, output: RequestOutput) -> list[ChoiceDelta]:
        self._final[prompt_index] = output
        deltas = []
        for completion in output.outputs:
            delta = self._advance(prompt_index * self._n + completion.index, completion)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _advance(self, index: int, completion: CompletionOutput) -> ChoiceDelta | None:
        progress = self._progress.setdefault(index, _ChoiceProgress())
        if progress.finished:
            return None
        finished = completion.finish_reason is not None
        text = completion.text[progress.text_sent :]
        token_ids = completion.token_ids[progress.tokens_sent :]
        logprobs = None if completion.logprobs is None else completion.logprobs[progress.tokens_sent :]
        if not text and not token_ids and not finished:
            return None
        delta = ChoiceDelta(index, text, token_ids, logprobs, completion.finish_reason, not progress.started)
        progress.text_sent += len(text)
        progress.tokens_sent = len(completion.token_ids)
        progress.started, progress.finished = True, finished
        return delta


_END = object()


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams in arrival order, tagging each item with its stream's index."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    arrivals: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                arrivals.put_nowait((index, output))
            arrivals.put_nowait((index, _END))
        except Exception as error:  # re-raised in the consumer, where the response is built
            arrivals.put_nowait((index, error))

    pumps = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        running = len(pumps)
        while running:
            index, item = await arrivals.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
