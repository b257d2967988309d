"""The router's gRPC client of one v3 shard (grpc.aio on a unix socket)."""

from __future__ import annotations

import asyncio

import grpc

from paged_backend.tgi.proto import generate_pb2 as pb
from paged_backend.tgi.proto import generate_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 2**31 - 1
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


class ShardClient:
    def __init__(self, url: str) -> None:
        self.channel = grpc.aio.insecure_channel(url, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.TextGenerationServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def health(self) -> None:
        await self.stub.Health(pb.HealthRequest())

    async def clear_cache(self, batch_id: int | None = None) -> None:
        request = pb.ClearCacheRequest() if batch_id is None else pb.ClearCacheRequest(id=batch_id)
        await self.stub.ClearCache(request)

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> pb.CachedBatch:
        response = await self.stub.FilterBatch(pb.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids))
        return response.batch

    async def prefill(self, batch: pb.Batch) -> pb.PrefillResponse:
        return await self.stub.Prefill(pb.PrefillRequest(batch=batch))

    async def decode(self, batches: list[pb.CachedBatch]) -> pb.DecodeResponse:
        return await self.stub.Decode(pb.DecodeRequest(batches=batches))


class ShardedClient:
    """Every shard of a sharded model, driven as one, as TGI's router does. Each call goes to all shards at once
    (they run the same batch, SPMD, so their all-reduces pair up). A shard answers Prefill / Decode with the
    generations of its own requests (`request.id % world_size == rank`); the answers are merged, with the slowest
    shard's timings. The other calls answer the same on every shard: rank 0's is kept."""

    def __init__(self, urls: list[str]) -> None:
        self.clients = [ShardClient(url) for url in urls]

    async def _all(self, name: str, *args) -> list:
        return await asyncio.gather(*(getattr(client, name)(*args) for client in self.clients))

    async def _merged(self, name: str, *args):
        responses = await self._all(name, *args)
        merged = type(responses[0])()
        merged.CopyFrom(max(responses, key=lambda response: response.total_ns))
        del merged.generations[:]
        merged.generations.extend(generation for response in responses for generation in response.generations)
        return merged

    async def close(self) -> None:
        await self._all("close")

    async def health(self) -> None:
        await self._all("health")

    async def clear_cache(self, batch_id: int | None = None) -> None:
        await self._all("clear_cache", batch_id)

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> pb.CachedBatch:
        return (await self._all("filter_batch", batch_id, request_ids))[0]

    async def prefill(self, batch: pb.Batch) -> pb.PrefillResponse:
        return await self._merged("prefill", batch)

    async def decode(self, batches: list[pb.CachedBatch]) -> pb.DecodeResponse:
        return await self._merged("decode", batches)
