"""The router's gRPC client of one v3 shard (grpc.aio on a unix socket)."""

from __future__ import annotations

import grpc

from paged_backend.tgi.generated import generate_pb2 as pb
from paged_backend.tgi.generated import generate_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 2**31 - 1


class ShardClient:
    def __init__(self, url: str) -> None:
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        self.channel = grpc.aio.insecure_channel(url, options=options)
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
