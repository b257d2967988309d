"""`generate.v3.TextGenerationService` over `ShardModel`: batches are cached by id between calls."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from paged_backend.errors import InvalidRequest, PagedBackendError
from paged_backend.tgi.backends.tokens import generated_text, token_text
from paged_backend.tgi.proto import generate_pb2 as pb
from paged_backend.tgi.proto import generate_pb2_grpc as pb_grpc
from paged_backend.tgi.shard.batch import ShardBatch, request_from_pb
from paged_backend.tgi.shard.model import ShardModel, TokenResult

logger = logging.getLogger(__name__)

FINISH_REASONS = {
    "length": pb.FINISH_REASON_LENGTH,
    "eos_token": pb.FINISH_REASON_EOS_TOKEN,
    "stop_sequence": pb.FINISH_REASON_STOP_SEQUENCE,
}


class TextGenerationService(pb_grpc.TextGenerationServiceServicer):
    def __init__(self, model: ShardModel, server_urls: list[str], use_prefix_caching: bool = False) -> None:
        self.model = model
        self.use_prefix_caching = use_prefix_caching
        self.server_urls = server_urls
        self.cache: dict[int, ShardBatch] = {}
        # The model and pool are used by one call at a time; the event loop stays free for Health.
        self.lock = asyncio.Lock()
        self.special_ids = set(model.tokenizer.all_special_ids)

    async def Info(self, request, context):
        return pb.InfoResponse(
            requires_padding=False,
            dtype=str(self.model.model.dtype),
            device_type=self.model.device.type,
            speculate=0,
            support_chunking=False,
            use_prefix_caching=self.use_prefix_caching,
            attention_impl="paged",
            block_size=self.model.block_size,
        )

    async def Health(self, request, context):
        return pb.HealthResponse()

    async def ServiceDiscovery(self, request, context):
        return pb.ServiceDiscoveryResponse(urls=self.server_urls)

    async def ClearCache(self, request, context):
        if request.HasField("id"):
            self.cache.pop(request.id, None)
        else:
            self.cache.clear()
        return pb.ClearCacheResponse()

    async def FilterBatch(self, request, context):
        (batch,) = await self._take(context, [request.batch_id])
        try:
            batch = batch.filter(list(request.request_ids))
        except PagedBackendError as error:
            self.cache[batch.id] = batch  # a bad filter leaves the batch as it was
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        self.cache[batch.id] = batch
        return pb.FilterBatchResponse(batch=batch.to_pb(pb))

    async def Warmup(self, request, context):
        async with self.lock:
            return await self._run(context, asyncio.to_thread(self._warmup, request))

    async def Prefill(self, request, context):
        if request.HasField("cached_batch"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "Prefill with a cached batch needs support_chunking, which is off"
            )
        if self.model.kv_cache is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Prefill before Warmup: Warmup sizes the KV pool")
        start = time.perf_counter_ns()
        async with self.lock:
            batch = await self._run(context, asyncio.to_thread(self._batch_from_pb, request.batch))
            return await self._step_response(pb.PrefillResponse, context, batch, start)

    async def Decode(self, request, context):
        start = time.perf_counter_ns()
        if not request.batches:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Decode needs at least one cached batch")
        async with self.lock:
            batches = await self._take(context, [cached.id for cached in request.batches])
            batch = ShardBatch.concatenate(batches) if len(batches) > 1 else batches[0]
            concat_ns = time.perf_counter_ns() - start
            return await self._step_response(pb.DecodeResponse, context, batch, start, concat_ns=concat_ns)

    # ---- helpers ---------------------------------------------------------------------------------------

    async def _run(self, context, work):
        try:
            return await work
        except PagedBackendError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except Exception as error:
            logger.exception("shard call failed")
            await context.abort(grpc.StatusCode.INTERNAL, str(error))

    async def _step_response(self, response_type, context, batch: ShardBatch, start: int, **timings):
        """One step of `batch`, answered as Prefill and Decode both answer: generations, the batch left, timings."""
        generations, cached, forward_ns = await self._run(context, asyncio.to_thread(self._step, batch))
        return response_type(
            generations=generations,
            batch=cached,
            forward_ns=forward_ns,
            decode_ns=0,
            total_ns=time.perf_counter_ns() - start,
            **timings,
        )

    async def _take(self, context, batch_ids: list[int]) -> list[ShardBatch]:
        """The cached batches, all or none: one unknown id leaves the others cached (they were lost before)."""
        missing = [batch_id for batch_id in batch_ids if batch_id not in self.cache]
        if missing or len(set(batch_ids)) < len(batch_ids):
            what = f"batch {missing[0]} not found in the shard cache" if missing else "a batch is named twice"
            await context.abort(grpc.StatusCode.NOT_FOUND if missing else grpc.StatusCode.INVALID_ARGUMENT, what)
        return [self.cache.pop(batch_id) for batch_id in batch_ids]

    def _batch_from_pb(self, batch) -> ShardBatch:
        model = self.model
        if not batch.requests:
            raise InvalidRequest(f"batch {batch.id} has no requests")
        num_blocks = model.num_blocks or None  # no pool before the first Warmup, which lays out its own blocks
        requests = [
            request_from_pb(r, model.tokenizer, model.eos_ids, model.block_size, num_blocks) for r in batch.requests
        ]
        shard_batch = ShardBatch(batch.id, requests, model.block_size)
        model.check_grammars(shard_batch)
        return shard_batch

    def _warmup(self, request) -> pb.WarmupResponse:
        model = self.model
        batch = self._batch_from_pb(request.batch)
        num_blocks = model.allocate_pool()
        model.assign_blocks(batch)
        model.generate_token(batch)
        max_supported = num_blocks * model.block_size
        max_total = request.max_total_tokens if request.HasField("max_total_tokens") else None
        if max_total is None:
            max_total = min(max_supported, model.max_position_embeddings)
        max_input = request.max_input_tokens if request.HasField("max_input_tokens") else max_total - 1
        logger.info("warmup done: %d KV tokens, max_input %d, max_total %d", max_supported, max_input, max_total)
        return pb.WarmupResponse(
            max_supported_total_tokens=max_supported, max_input_tokens=max_input, max_total_tokens=max_total
        )

    def _step(self, batch: ShardBatch):
        results, forward_ns = self.model.generate_token(batch)
        # Sharded, every rank runs every request but reports only its share, by batch position as TGI's shards
        # do (`i % world_size == rank`): the router appends the shards' answers into one list.
        rank = self.model.rank
        mine = [result for i, result in enumerate(results) if i % rank.world_size == rank.rank]
        generations = [self._generation(result) for result in mine]
        running = [result.request for result in results if result.finish_reason is None]
        cached = None
        if running:
            batch = ShardBatch(batch.id, running, batch.block_size)
            self.cache[batch.id] = batch
            cached = batch.to_pb(pb)
        return generations, cached, forward_ns

    def _tokens(self, ids: list[int], logprobs: list[float], texts: list[str]) -> pb.Tokens:
        return pb.Tokens(ids=ids, logprobs=logprobs, texts=texts, is_special=[i in self.special_ids for i in ids])

    def _texts(self, ids: list[int]) -> list[str]:
        return [token_text(self.model.tokenizer, i) for i in ids]

    def _generation(self, result: TokenResult) -> pb.Generation:
        request = result.request
        generation = pb.Generation(
            request_id=request.id,
            tokens=self._tokens([result.token_id], [result.logprob], [result.text]),
        )
        if result.prefill_logprobs is not None:
            prompt = request.seq.token_ids[: request.seq.num_prompt_tokens]
            generation.prefill_tokens.CopyFrom(self._tokens(prompt, result.prefill_logprobs, self._texts(prompt)))
        if result.top_tokens:
            ids = [token_id for token_id, _ in result.top_tokens]
            top = self._tokens(ids, [logprob for _, logprob in result.top_tokens], self._texts(ids))
            generation.top_tokens.append(top)
        if result.finish_reason is not None:
            chooser = request.chooser
            generated = pb.GeneratedText(
                text=generated_text(self.model.tokenizer, request.generated_ids),
                generated_tokens=len(request.generated_ids),
                finish_reason=FINISH_REASONS[result.finish_reason],
            )
            if chooser.do_sample:
                generated.seed = chooser.seed
            generation.generated_text.CopyFrom(generated)
        return generation
