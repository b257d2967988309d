"""AsyncEngine: one thread steps the (not thread-safe) Engine; asyncio callers add, stream and abort.

Every engine call (add, abort, step, stats) runs on that thread, fed by a command queue, so no lock is held
across a step and the event loop never blocks on the model. Outputs go back to per-request asyncio queues.

>>> async def main(engine):                       # doctest: +SKIP
...     async_engine = AsyncEngine(engine)
...     await async_engine.start()
...     async for output in async_engine.generate("r1", "Hello", SamplingParams(max_tokens=4)):
...         print(output.outputs[0].text)
...     await async_engine.shutdown(drain_timeout=5)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from paged_backend.engine.request import RequestOutput
from paged_backend.engine.sleep import EngineSleep
from paged_backend.errors import InvalidRequest, PagedBackendError

if TYPE_CHECKING:
    from paged_backend.engine.engine import Engine
    from paged_backend.engine.stats import EngineStats

logger = logging.getLogger(__name__)
SLEEP_RETRY_AFTER = 10  # seconds: the Retry-After of a request refused while the engine sleeps


class EngineNotRunning(PagedBackendError):
    """The engine loop is not accepting requests (not started yet, or shutting down); retry elsewhere."""


class EngineAsleep(EngineNotRunning):
    """The engine is asleep (sleep mode); `retry_after` is the seconds a client should wait before trying again."""

    def __init__(self, level: int, retry_after: int = SLEEP_RETRY_AFTER) -> None:
        self.retry_after = retry_after
        super().__init__(f"the engine is asleep (level {level}) and serves nothing until POST /wake_up; "
                         f"retry in {retry_after} s or elsewhere")  # fmt: skip


class RequestAborted(PagedBackendError):
    """The request was aborted before it finished (server shutdown or an explicit abort)."""


class EngineStepFailed(RuntimeError):
    """An engine step raised; every request in flight at that moment is failed with this error."""


_STOP = object()  # command-queue sentinel that ends the engine loop


class EngineThread:
    """The one thread that builds an engine and then steps it (`AsyncEngine(engine, engine_thread)`).

    Torch's OpenMP work runs 20-30% slower on a thread other than the first one to use it (measured on the
    project's 2-core box: the same `LLM.generate` at 31.9 against 40.9 ms per token), so a server loads the model,
    packs its weights and steps it on this one thread, and its event loop does no torch work of its own."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._work, name="paged-backend-engine", daemon=True)
        self.thread.start()

    def submit(self, function: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `function` on the thread after what was submitted before; its result or error comes in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((function, future))
        return future

    def close(self) -> None:
        """End the thread once its submitted work is done."""
        self._jobs.put((None, None))

    def _work(self) -> None:
        while True:
            function, future = self._jobs.get()
            if function is None:
                return
            try:
                future.set_result(function())
            except BaseException as error:  # handed to whoever waits on the future
                future.set_exception(error)


class AsyncEngine:
    """Continuous batching for asyncio: requests join the running batch at the next step."""

    def __init__(self, engine: Engine, engine_thread: EngineThread | None = None) -> None:
        self.engine = engine
        self._owns_thread = False  # an engine thread made by start() is closed by shutdown()
        self._commands: queue.SimpleQueue[Callable[[], None] | object] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}  # event-loop side only
        self._live_request_ids: set[str] = set()  # engine-thread side only
        self._stats = engine.stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine_thread = engine_thread
        self._running: concurrent.futures.Future | None = None  # the loop, on the engine thread
        self._accepting = False
        self._idle = asyncio.Event()
        self._sleep = EngineSleep(engine)  # changed on the engine thread only, read anywhere
        self.on_fatal: Callable[[BaseException], None] | None = None  # told, from the engine thread, of a dead engine

    async def start(self) -> None:
        """Start the engine thread; requests are accepted from now on."""
        self._loop = asyncio.get_running_loop()
        if self._engine_thread is None:
            self._engine_thread, self._owns_thread = EngineThread(), True
        self._running = self._engine_thread.submit(self._run)
        self._accepting = True
        self._idle.set()

    async def shutdown(self, drain_timeout: float) -> None:
        """Stop accepting, let in-flight requests finish for up to `drain_timeout` s, abort the rest, stop."""
        self._accepting = False
        if self._running is None:
            return
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=drain_timeout)
        except asyncio.TimeoutError:
            logger.warning("aborting %d request(s) still running after %.1f s", len(self._streams), drain_timeout)
        for request_id in list(self._streams):
            self.abort(request_id)
        self._commands.put(_STOP)
        await asyncio.wrap_future(self._running)
        self._running = None
        if self._owns_thread:
            self._engine_thread.close()
            self._engine_thread = None

    async def generate(self, request_id: str, *args, **kwargs) -> AsyncIterator[RequestOutput]:
        """Add a request (the arguments of `Engine.add_request`) and yield its cumulative outputs until it finishes.

        Bad input raises InvalidRequest / PromptTooLong before the first output. Closing or cancelling the
        iterator early (a client disconnect) aborts the request, which frees its blocks at once.
        """
        if not self._accepting:
            raise EngineNotRunning("the engine is not accepting requests (starting or shutting down); retry later")
        if self._sleep.level:
            raise EngineAsleep(self._sleep.level)
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already running; use a unique id")
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = outputs
        self._idle.clear()
        finished = False
        try:
            try:
                added = self._call_on_engine_thread(lambda: self._add(request_id, args, kwargs))
                # Queued first, so that a step cut for it (it outranks all the step computes) is followed by its own.
                self.engine.cut_step_for(kwargs.get("priority", 0), kwargs.get("request_class", "interactive"))
                await added
            except PagedBackendError:
                finished = True  # rejected: nothing was queued, nothing to abort
                raise
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            del self._streams[request_id]
            if not self._streams:
                self._idle.set()
            if not finished:
                self.abort(request_id)

    async def run_on_engine_thread(self, function: Callable[[], Any]) -> Any:
        """Run `function` between two engine steps (it may change the engine) and return its result."""
        return await self._call_on_engine_thread(function)

    async def sleep(self, level: int) -> None:
        """Sleep at `level` between two steps (`engine.sleep.EngineSleep.sleep`): 1 frees the KV pool, 2 the weights
        too. Raises EngineBusy, freeing nothing, while requests run; requests that arrive asleep get EngineAsleep."""
        self._check_running()
        await self._call_on_engine_thread(lambda: self._sleep.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what the sleep freed, or only `tags` ("weights": level 2 reloads them from the engine config's
        model; "kv_cache": the pool)."""
        self._check_running()
        await self._call_on_engine_thread(lambda: self._sleep.wake_up(tags))

    def _check_running(self) -> None:
        if not self._accepting:  # a stopped loop would never run the command
            raise EngineNotRunning("the engine is not running (starting or shutting down); retry later")

    @property
    def sleep_level(self) -> int:
        """0 while awake, else the level the engine sleeps at."""
        return self._sleep.level

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent); its blocks are freed at the next turn of the engine thread."""
        self._commands.put(lambda: self._abort(request_id))

    def stats(self) -> EngineStats:
        """The engine's EngineStats as of the end of the latest engine-thread iteration."""
        return self._stats

    def call(self, function: Callable[[], Any]) -> asyncio.Future:
        """Run `function` on the engine thread between steps (a consistent view of the engine); await its result."""
        return self._call_on_engine_thread(function)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def accepting(self) -> bool:
        """True between start() and the beginning of shutdown()."""
        return self._accepting

    # ---- event-loop side -------------------------------------------------------------------------------

    def _call_on_engine_thread(self, function: Callable[[], Any]) -> asyncio.Future:
        future = self._loop.create_future()

        def run() -> None:
            try:
                result = function()
            except BaseException as error:  # handed to the awaiting caller, never swallowed
                self._loop.call_soon_threadsafe(_resolve, future, None, error)
            else:
                self._loop.call_soon_threadsafe(_resolve, future, result, None)

        self._commands.put(run)
        return future

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(item)

    # ---- engine-thread side ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if not self._drain_commands(block=not self.engine.has_unfinished_requests()):
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                self._stats = self.engine.stats()
            except Exception as error:  # a broken step fails its requests; the loop itself keeps serving
                logger.exception("engine step failed; failing %d request(s) in flight", len(self._live_request_ids))
                self._fail_live_requests(error)
                if getattr(error, "fatal", False):  # the engine cannot step again (a parallel rank is gone)
                    self._accepting = False
                    if self.on_fatal is not None:
                        self.on_fatal(error)

    def _drain_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one when idle); False once the stop sentinel arrives."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            try:
                command()
            except Exception:  # one bad command (an abort that raised) must not stop the loop
                logger.exception("engine command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request_id: str, args: tuple, kwargs: dict) -> None:
        if self._sleep.level:  # it passed generate()'s check while a sleep was queued ahead of it
            raise EngineAsleep(self._sleep.level)
        self.engine.add_request(request_id, *args, **kwargs)
        self._live_request_ids.add(request_id)

    def _abort(self, request_id: str) -> None:
        if request_id not in self._live_request_ids:
            return
        self.engine.abort_request(request_id)
        self._live_request_ids.discard(request_id)
        error = RequestAborted(f"request {request_id!r} was aborted before it finished")
        self._loop.call_soon_threadsafe(self._deliver, [(request_id, error)])

    def _step(self) -> None:
        outputs = self.engine.step()
        for output in outputs:
            if output.finished:
                self._live_request_ids.discard(output.request_id)
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, [(output.request_id, output) for output in outputs])

    def _fail_live_requests(self, cause: Exception) -> None:
        failed = list(self._live_request_ids)
        for request_id in failed:
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %r after a failed step also failed", request_id)
        self._live_request_ids.clear()
        self._stats = self.engine.stats()  # their blocks are free again: /metrics says so before the next step
        error = EngineStepFailed(f"the engine failed while running this request: {cause!r}")
        self._loop.call_soon_threadsafe(self._deliver, [(request_id, error) for request_id in failed])


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
