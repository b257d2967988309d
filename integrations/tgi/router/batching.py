"""The continuous-batching loop of TGI's v3 router (`batching_task`), over a `ShardClient`.

Prefill a new batch, then decode it step by step; between steps, when enough requests wait
(`waiting_served_ratio`) or running ones have waited long enough (`max_waiting_tokens`), prefill them
as a second batch and decode both together. Finished and dropped requests are filtered out and their
blocks freed after every call.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import grpc

from paged_backend.core.block_manager import BlockManager
from paged_backend.tgi.backends.base import GeneratedToken, PrefillTokens
from paged_backend.tgi.http.errors import GenerationError
from paged_backend.tgi.http.metrics import TgiMetrics
from paged_backend.tgi.proto import generate_pb2 as pb
from paged_backend.tgi.router.client import ShardClient
from paged_backend.tgi.router.queue import Entry, Queue

logger = logging.getLogger(__name__)

FINISH_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_EOS_TOKEN: "eos_token",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
}


@dataclass
class BatchingSettings:
    max_batch_prefill_tokens: int = 4096
    max_batch_size: int | None = None
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20


def _logprob(value: float) -> float | None:
    return None if math.isnan(value) else value


class BatchingLoop:
    def __init__(
        self,
        client: ShardClient,
        queue: Queue,
        block_manager: BlockManager,
        settings: BatchingSettings,
        metrics: TgiMetrics,
    ):
        self.client = client
        self.queue = queue
        self.block_manager = block_manager
        self.settings = settings
        self.metrics = metrics
        self.running: dict[int, Entry] = {}
        self.healthy = False  # TGI starts unhealthy: the first /health runs a liveness prefill

    async def run(self) -> None:
        settings = self.settings
        while True:
            await self.queue.has_entries.wait()
            while cut := self.queue.next_batch(None, settings.max_batch_size, settings.max_batch_prefill_tokens):
                cached = await self._prefill(*cut)
                waiting_tokens = 1
                while cached is not None:
                    batches = [cached]
                    min_size = None
                    if waiting_tokens < settings.max_waiting_tokens:
                        min_size = math.floor(cached.size * settings.waiting_served_ratio)
                    max_size = None if settings.max_batch_size is None else settings.max_batch_size - cached.size
                    if max_size is None or max_size > 0:
                        cut = self.queue.next_batch(min_size or None, max_size, settings.max_batch_prefill_tokens)
                        if cut is not None:
                            reason = "backpressure" if min_size else "wait_exceeded"
                            self.metrics.batch_concat.inc(reason=reason)
                            added = await self._prefill(*cut)
                            if added is not None:
                                batches.append(added)
                            waiting_tokens = 1
                    cached = await self._decode(batches)
                    waiting_tokens += 1

    async def _prefill(self, batch: pb.Batch, entries: dict[int, Entry]) -> pb.CachedBatch | None:
        self.running.update(entries)
        self.metrics.batch_next_size.observe(batch.size)
        call = self.client.prefill(batch)
        return await self._step("prefill", call, [batch.id], list(entries))

    async def _decode(self, batches: list[pb.CachedBatch]) -> pb.CachedBatch | None:
        call = self.client.decode(batches)
        return await self._step("decode", call, [b.id for b in batches], [i for b in batches for i in b.request_ids])

    async def _step(self, method: str, call, batch_ids: list[int], request_ids: list[int]) -> pb.CachedBatch | None:
        """Await one Prefill/Decode, stream its tokens, filter what ended; count it as TGI's router does."""
        metrics = self.metrics
        metrics.batch_inference_count.inc(method=method)
        start = time.monotonic()
        try:
            response = await call
        except grpc.RpcError as error:
            metrics.batch_inference_failure.inc(method=method)
            await self._fail(batch_ids, request_ids, error)
            return None
        self.healthy = True
        metrics.batch_inference_success.inc(method=method)
        metrics.batch_forward_duration.labels(method=method).observe(response.forward_ns / 1e9)
        metrics.batch_decode_duration.labels(method=method).observe(response.decode_ns / 1e9)
        if response.HasField("concat_ns"):
            metrics.batch_concat_duration.labels(method=method).observe(response.concat_ns / 1e9)
        metrics.batch_inference_duration.labels(method=method).observe(time.monotonic() - start)
        self._dispatch(response.generations)
        filter_start = time.monotonic()
        cached = await self._filter(response.batch if response.HasField("batch") else None)
        metrics.batch_filter_duration.labels(method=method).observe(time.monotonic() - filter_start)
        return cached

    def _dispatch(self, generations) -> None:
        for generation in generations:
            entry = self.running.get(generation.request_id)
            if entry is None:
                continue
            if generation.prefill_tokens.ids:
                prefill = generation.prefill_tokens
                logprobs = [_logprob(value) for value in prefill.logprobs]
                entry.events.put_nowait(PrefillTokens(list(prefill.ids), logprobs))
            top = [list(zip(t.ids, t.logprobs, strict=True)) for t in generation.top_tokens]
            finished = generation.HasField("generated_text")
            reason = FINISH_REASONS[generation.generated_text.finish_reason] if finished else None
            for index, (token_id, logprob) in enumerate(
                zip(generation.tokens.ids, generation.tokens.logprobs, strict=True)
            ):
                last = index == len(generation.tokens.ids) - 1
                tops = top[index] if index < len(top) else []
                entry.events.put_nowait(GeneratedToken(token_id, logprob, tops, reason if last else None))
            if finished:
                self._release(entry.id)

    def _release(self, request_id: int) -> None:
        self.running.pop(request_id, None)
        self.block_manager.free(request_id)

    async def _filter(self, cached: pb.CachedBatch | None) -> pb.CachedBatch | None:
        """Drop finished and disconnected requests from the shard's batch (ClearCache when none is left)."""
        if cached is None:
            return None
        for request_id in list(cached.request_ids):
            entry = self.running.get(request_id)
            if entry is not None and entry.dropped:
                self._release(request_id)
        keep = [request_id for request_id in cached.request_ids if request_id in self.running]
        if len(keep) == len(cached.request_ids):
            return cached
        if not keep:
            await self.client.clear_cache(cached.id)
            return None
        return await self.client.filter_batch(cached.id, keep)

    async def _fail(self, batch_ids: list[int], request_ids: list[int], error: grpc.RpcError) -> None:
        """A shard error fails every request of the batch (TGI: GenerationError) and marks us unhealthy."""
        logger.error("shard call failed: %s", error)
        self.healthy = False
        for batch_id in batch_ids:
            try:
                await self.client.clear_cache(batch_id)
            except grpc.RpcError:
                logger.exception("ClearCache(%d) after a failure also failed", batch_id)
        message = error.details() if hasattr(error, "details") else str(error)
        for request_id in request_ids:
            entry = self.running.get(request_id)
            if entry is not None:
                entry.events.put_nowait(GenerationError(message))
                self._release(request_id)
