"""Serve the shard on `unix://{uds_path}-{rank}`; the socket file appearing is TGI's readiness signal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

import grpc

from paged_backend.tgi.proto import generate_pb2_grpc as pb_grpc
from paged_backend.tgi.shard.model import ShardModel
from paged_backend.tgi.shard.service import TextGenerationService

logger = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 2**31 - 1  # batches of long prompts exceed gRPC's 4 MiB default
SHUTDOWN_GRACE_SECONDS = 5.0


def socket_path(uds_path: str, rank: int) -> str:
    return f"{uds_path}-{rank}"


async def serve(
    model: ShardModel, uds_path: str, rank: int = 0, world_size: int = 1, use_prefix_caching: bool = False
) -> None:
    local = socket_path(uds_path, rank)
    urls = [f"unix://{socket_path(uds_path, r)}" for r in range(world_size)]
    with contextlib.suppress(FileNotFoundError):
        os.remove(local)  # a stale socket of an earlier run would make readiness lie
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    server = grpc.aio.server(options=options)
    pb_grpc.add_TextGenerationServiceServicer_to_server(TextGenerationService(model, urls, use_prefix_caching), server)
    server.add_insecure_port(f"unix://{local}")
    await server.start()
    logger.info("shard %d serving generate.v3 on unix://%s", rank, local)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(SHUTDOWN_GRACE_SECONDS)
    with contextlib.suppress(FileNotFoundError):
        os.remove(local)
