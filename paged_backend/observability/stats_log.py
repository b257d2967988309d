"""vLLM's periodic engine stats line (`--disable-log-stats` turns it off): throughput, queue and KV use, logged from
the engine's stats every interval."""

from __future__ import annotations

import asyncio
import logging
import time

from paged_backend.engine.async_engine import AsyncEngine
from paged_backend.engine.stats import EngineStats

logger = logging.getLogger(__name__)


class StatsLogger:
    """vLLM's periodic stats line (off with `--disable-log-stats`): every `interval` seconds, the prompt and
    generation throughput since the last line, running / waiting / swapped requests, KV cache usage and the prefix
    cache hit rate, from the engine's stats. At INFO when this interval or the one before generated anything, else
    at DEBUG, so an idle server stays quiet (vLLM's rule)."""

    def __init__(self, async_engine: AsyncEngine, interval: float, model_name: str) -> None:
        self.async_engine, self.interval, self.model_name = async_engine, interval, model_name
        self._task: asyncio.Task | None = None
        self._last: EngineStats | None = None
        self._last_time = 0.0
        self._last_throughputs = (0.0, 0.0)

    def start(self) -> None:
        self._last, self._last_time = self.async_engine.stats(), time.monotonic()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.log()
            except Exception:  # a stats line must never stop the server
                logger.exception("stats logging failed")

    def log(self) -> None:
        stats, now = self.async_engine.stats(), time.monotonic()
        level, line = self.line(stats, now)
        logger.log(level, line)

    def line(self, stats: EngineStats, now: float) -> tuple[int, str]:
        """The level and text of the line for `stats` at `now` (time.monotonic), against the previous line's."""
        last, elapsed = self._last, max(now - self._last_time, 1e-9)
        prompt = (stats.prompt_tokens - last.prompt_tokens) / elapsed
        generation = (stats.generation_tokens - last.generation_tokens) / elapsed
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hit_rate = (stats.prefix_cache_hits - last.prefix_cache_hits) / queries if queries else stats.prefix_cache_hit_rate
        active = any((prompt, generation, *self._last_throughputs))
        self._last, self._last_time, self._last_throughputs = stats, now, (prompt, generation)
        text = (f"{self.model_name}: Avg prompt throughput: {prompt:.1f} tokens/s, Avg generation throughput: "
                f"{generation:.1f} tokens/s, Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"Swapped: {stats.num_swapped} reqs, KV cache usage: {stats.kv_usage * 100:.1f}%, "
                f"Prefix cache hit rate: {hit_rate * 100:.1f}%")  # fmt: skip
        return (logging.INFO if active else logging.DEBUG), text
