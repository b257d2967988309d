"""A real OTLP/HTTP receiver (oteltap) on its own event-loop thread, keeping every span it receives."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

from tests._tgi_helpers import free_port


class OtlpReceiver:
    def __init__(self, oteltap) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"
        self.spans: list = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        settings = oteltap.OtelTapHttpProtobufReceiverSettings(http_port=self.port)
        self.receiver = oteltap.OtelTapHttpProtobufReceiver(settings)
        self._call(self._start())

    def _call(self, coroutine, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def _start(self) -> None:
        await self.receiver.start()
        self._collector = asyncio.ensure_future(self._collect())
        await asyncio.sleep(0.05)  # the collector subscribes on its first step

    async def _collect(self) -> None:
        async for span in self.receiver.stream_traces():
            self.spans.append(span)

    def wait_for(self, predicate, count: int, timeout: float = 30) -> list:
        """At least `count` received spans matching `predicate`."""
        deadline = time.monotonic() + timeout
        while True:
            matching = [span for span in list(self.spans) if predicate(span)]
            if len(matching) >= count:
                return matching
            assert time.monotonic() < deadline, f"{len(matching)} of {count} spans after {timeout} s"
            time.sleep(0.1)

    def stop(self) -> None:
        self._call(self.receiver.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@contextmanager
def otlp_receiver():
    """A running receiver, or None where oteltap is not installed."""
    try:
        import oteltap
    except ImportError:
        yield None
        return
    receiver = OtlpReceiver(oteltap)
    try:
        yield receiver
    finally:
        receiver.stop()
