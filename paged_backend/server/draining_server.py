"""uvicorn, but a shutdown (SIGTERM) first drains the engine: in-flight requests finish within the drain
timeout or are aborted with a clean error, so no connection has to be cut and no task cancelled."""

from __future__ import annotations

import socket

import uvicorn

from paged_backend.engine.async_engine import AsyncEngine


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self.async_engine, self.drain_timeout = async_engine, drain_timeout
        self.exit_code = 0
        async_engine.on_fatal = self._stop_after_fatal_error

    def _stop_after_fatal_error(self, error: BaseException) -> None:
        """The engine is dead (its requests already got their 5xx): shut down and exit non-zero."""
        self.exit_code = 1
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.async_engine.shutdown(self.drain_timeout)
        await super().shutdown(sockets=sockets)
