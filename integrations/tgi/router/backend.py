"""`GrpcBackend`: the HTTP face's backend that routes requests through `BatchingLoop` to a v3 shard.

Start-up follows TGI's router: ServiceDiscovery on the master shard, ClearCache, Info, Warmup (which
sizes the router's block pool), then serving. Health is the `Health` RPC after a successful generation,
otherwise a liveness prefill on the reserved block 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import grpc

from paged_backend.core.block_manager import BlockManager
from paged_backend.tgi.backends.base import BackendEvent, BackendLoad, GeneratedToken
from paged_backend.tgi.backends.tokens import eos_token_ids
from paged_backend.tgi.http.errors import TgiError
from paged_backend.tgi.http.grammar import GrammarCompiler
from paged_backend.tgi.http.metrics import TgiMetrics
from paged_backend.tgi.http.validation import ValidRequest
from paged_backend.tgi.proto import generate_pb2 as pb
from paged_backend.tgi.proto import generate_pb2_grpc as pb_grpc
from paged_backend.tgi.router.batching import BatchingLoop, BatchingSettings
from paged_backend.tgi.router.client import CHANNEL_OPTIONS, ShardedClient
from paged_backend.tgi.router.queue import Entry, Queue

logger = logging.getLogger(__name__)
U64_MAX = 2**64 - 1
WARMUP_TEXT = "_test "


def load_tokenizer(model_id: str | None, tokenizer_name: str | None):
    """The router validates and counts tokens itself, so it needs the model's tokenizer (not its weights)."""
    from paged_backend.worker.models import load_tokenizer

    return load_tokenizer(model_id, tokenizer_name)


SHARD_WAIT_S = 60  # a shard started beside the router may still be loading its weights


def wait_for_shard(channel: grpc.Channel, master: str, started_here: bool) -> None:
    """Wait for the master shard to answer, saying so when its socket is not there yet; a clear exit if it never
    answers (a traceback before)."""
    if not started_here and not os.path.exists(master):
        logger.warning("no shard at %s yet; waiting up to %d s for one (`text-generation-server serve "
                       "--uds-path %s`)", master, SHARD_WAIT_S, master.removesuffix("-0"))  # fmt: skip
    try:
        grpc.channel_ready_future(channel).result(timeout=SHARD_WAIT_S)
    except grpc.FutureTimeoutError:
        raise SystemExit(f"paged-backend launch: no shard answered at {master} within {SHARD_WAIT_S} s: start "
                         "one there, point --shard-uds-path (or --master-shard-uds-path) at its socket, or give "
                         "--num-shard N to start N here") from None  # fmt: skip


def warmup_chooser() -> pb.NextTokenChooserParameters:
    """The chooser TGI's router warms its shards up with: every logits processor on, so warmup runs them all."""
    return pb.NextTokenChooserParameters(
        temperature=0.9, top_k=10, top_p=0.9, typical_p=0.9, do_sample=False, seed=0, repetition_penalty=1.2,
        frequency_penalty=0.1, watermark=True,
    )


def warmup_batch(tokenizer, max_input_tokens: int | None, max_prefill_tokens: int, max_batch_size: int | None):
    """TGI's warmup batch: `_test ` prompts up to the prefill budget, worst-case parameters, no blocks."""
    requests, used = [], 0
    while used < max_prefill_tokens and (max_batch_size is None or len(requests) < max_batch_size):
        truncate = min(max_input_tokens or max_prefill_tokens, max_prefill_tokens - used)
        requests.append(
            pb.Request(
                id=0,
                inputs=WARMUP_TEXT * truncate,
                input_chunks=pb.Input(chunks=[pb.InputChunk(text=WARMUP_TEXT * truncate)]),
                truncate=truncate,
                add_special_tokens=True,
                prefill_logprobs=True,
                top_n_tokens=20,
                parameters=warmup_chooser(),
                stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=1, ignore_eos_token=True),
            )
        )
        used += truncate
    return pb.Batch(id=0, requests=requests, size=len(requests), max_tokens=max_input_tokens or 0)


def on_every_shard(urls: list[str], call) -> list:
    """`call(stub)` on every shard at the same time (blocking), answers in rank order."""
    with ExitStack() as stack, ThreadPoolExecutor(max_workers=len(urls)) as pool:
        stubs = [
            pb_grpc.TextGenerationServiceStub(stack.enter_context(grpc.insecure_channel(url, options=CHANNEL_OPTIONS)))
            for url in urls
        ]
        return list(pool.map(call, stubs))


def liveness_batch() -> pb.Batch:
    probe = pb.Request(
        id=U64_MAX,
        inputs="liveness",
        input_chunks=pb.Input(chunks=[pb.InputChunk(text="liveness")]),
        truncate=1,
        add_special_tokens=False,
        parameters=pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0),
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=1),
        blocks=[0],  # block 0 is reserved for health checks: never handed to a request
        slots=[0],
    )
    return pb.Batch(id=U64_MAX, requests=[probe], size=1, max_tokens=2, max_blocks=1)


class GrpcBackend:
    name = "grpc"
    supports_prefill_logprobs = True
    supports_grammar = True

    def __init__(
        self,
        shard_urls: list[str],
        tokenizer,
        info: pb.InfoResponse,
        warmup: pb.WarmupResponse,
        settings: BatchingSettings,
    ):
        self.shard_urls = shard_urls
        self.tokenizer = tokenizer
        self.block_size = info.block_size
        self.max_model_len = warmup.max_total_tokens
        num_blocks = warmup.max_supported_total_tokens // info.block_size
        self.block_manager = BlockManager(num_blocks, info.block_size, enable_prefix_caching=False, watermark=0.0)
        self.settings = settings
        self.grammars = GrammarCompiler(tokenizer, eos_token_ids(tokenizer))
        self._ids = itertools.count()
        self.client: ShardedClient | None = None
        self.loop: BatchingLoop | None = None
        self._task: asyncio.Task | None = None

    @classmethod
    def from_flags(cls, args: argparse.Namespace, shards_ready: Callable[[], None] | None = None) -> GrpcBackend:
        """Connect to the master shard and run TGI's start-up sequence (blocking, before serving). `shards_ready`
        waits for shards this process started; the tokenizer loads meanwhile."""
        master = args.master_shard_uds_path or f"{args.shard_uds_path}-0"
        tokenizer = load_tokenizer(args.model_id, args.tokenizer_name)
        if shards_ready is not None:
            shards_ready()
        with grpc.insecure_channel(f"unix://{master}") as channel:
            wait_for_shard(channel, master, started_here=shards_ready is not None)
            urls = list(pb_grpc.TextGenerationServiceStub(channel).ServiceDiscovery(pb.ServiceDiscoveryRequest()).urls)
        on_every_shard(urls, lambda stub: stub.ClearCache(pb.ClearCacheRequest()))
        info = on_every_shard(urls, lambda stub: stub.Info(pb.InfoRequest()))[0]
        if info.requires_padding or info.speculate or info.support_chunking:
            raise SystemExit("paged-backend launch: the shard needs padding, speculation or chunking; unsupported")
        request = pb.WarmupRequest(
            batch=warmup_batch(tokenizer, args.max_input_tokens, args.max_batch_prefill_tokens, args.max_batch_size),
            max_prefill_tokens=args.max_batch_prefill_tokens,
        )
        if args.max_input_tokens is not None:
            request.max_input_tokens = args.max_input_tokens
        if args.max_total_tokens is not None:
            request.max_total_tokens = args.max_total_tokens
        # Every shard must warm up at once (its forward all-reduces with the others); the smallest pool bounds all.
        warmups = on_every_shard(urls, lambda stub: stub.Warmup(request))
        warmup = min(warmups, key=lambda response: response.max_supported_total_tokens)
        # Block 0 is the health check's, so one request may use every other block (TGI: NotEnoughMemory).
        capacity = warmup.max_supported_total_tokens - info.block_size
        if warmup.max_total_tokens - 1 > capacity:
            raise SystemExit(
                f"paged-backend launch: `max_total_tokens` {warmup.max_total_tokens} does not fit the shard's "
                f"KV pool ({capacity} usable tokens): lower --max-total-tokens or give the shard more blocks"
            )
        if args.max_batch_total_tokens is not None:
            logger.warning("--max-batch-total-tokens is ignored: the shard reported its KV capacity at warmup")
        logger.info(
            "%d shard(s) at %s: %d KV tokens, block size %d",
            len(urls), ", ".join(urls), warmup.max_supported_total_tokens, info.block_size,
        )  # fmt: skip
        settings = BatchingSettings(
            max_batch_prefill_tokens=args.max_batch_prefill_tokens,
            max_batch_size=args.max_batch_size,
            waiting_served_ratio=args.waiting_served_ratio,
            max_waiting_tokens=args.max_waiting_tokens,
        )
        return cls(urls, tokenizer, info, warmup, settings)

    async def start(self, metrics: TgiMetrics) -> None:
        self.client = ShardedClient(self.shard_urls)
        self.queue = Queue(self.block_manager)
        self.loop = BatchingLoop(self.client, self.queue, self.block_manager, self.settings, metrics)
        self._task = asyncio.create_task(self.loop.run())

    async def shutdown(self, drain_timeout: float) -> None:
        deadline = asyncio.get_running_loop().time() + drain_timeout
        while (self.loop.running or len(self.queue)) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self.client.close()

    async def health(self) -> bool:
        try:
            if self.loop.healthy:
                await self.client.health()
            else:
                response = await self.client.prefill(liveness_batch())
                self.loop.healthy = len(response.generations) == 1
        except grpc.RpcError:
            self.loop.healthy = False
        return self.loop.healthy

    def load(self) -> BackendLoad:
        manager = self.block_manager
        capacity = (manager.num_blocks - 1) * manager.block_size
        used = (manager.num_blocks - 1 - manager.num_free_blocks) * manager.block_size
        return BackendLoad(len(self.queue), len(self.loop.running), used, capacity)

    async def generate(self, request: ValidRequest) -> AsyncIterator[BackendEvent]:
        if request.parameters.grammar is not None:  # a grammar the shard cannot compile would fail its whole batch
            await asyncio.to_thread(self.grammars.check, request.parameters.grammar)
        entry = Entry(next(self._ids), request)
        self.queue.append(entry)
        try:
            while True:
                event = await entry.events.get()
                if isinstance(event, TgiError):
                    raise event
                yield event
                if isinstance(event, GeneratedToken) and event.finish_reason is not None:
                    return
        finally:
            entry.dropped = True
