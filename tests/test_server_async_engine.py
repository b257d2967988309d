"""AsyncEngine over the real engine (embedded tiny model, CPU): batching, aborts, shutdown, failing steps."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from paged_backend.config import CacheConfig, EngineConfig
from paged_backend.engine import Engine, SamplingParams
from paged_backend.engine.async_engine import (
    AsyncEngine,
    EngineNotRunning,
    EngineStepFailed,
    EngineThread,
    RequestAborted,
)
from paged_backend.errors import InvalidRequest, PromptTooLong
from paged_backend.worker.default_model import TINY_MODEL

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model=TINY_MODEL, device="cpu", cache=CacheConfig(num_blocks=64)))


def run_with(engine: Engine, scenario) -> object:
    """Run `scenario(async_engine)` between start() and shutdown(); the engine must end with no request."""

    async def main():
        async_engine = AsyncEngine(engine)
        await async_engine.start()
        try:
            return await scenario(async_engine)
        finally:
            await async_engine.shutdown(drain_timeout=5)

    result = asyncio.run(main())
    assert not engine.has_unfinished_requests()
    assert engine.stats().kv_usage == 0
    return result


async def until_idle(async_engine: AsyncEngine, timeout: float = 10) -> None:
    """Wait for the engine thread to have freed everything (its stats snapshot shows it)."""
    deadline = time.monotonic() + timeout
    while async_engine.stats().kv_usage > 0 or async_engine.stats().num_running > 0:
        assert time.monotonic() < deadline, async_engine.stats()
        await asyncio.sleep(0.01)


def direct_tokens(engine: Engine, prompt: str, params: SamplingParams) -> list[int]:
    engine.add_request("direct", prompt, params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
    return outputs[0].outputs[0].token_ids


async def collect(async_engine: AsyncEngine, request_id: str, prompt: str, params: SamplingParams = GREEDY) -> list:
    return [output async for output in async_engine.generate(request_id, prompt, params)]


def test_outputs_grow_one_token_at_a_time_and_match_the_engine_run_directly(engine):
    expected = direct_tokens(engine, "Hello there", GREEDY)
    outputs = run_with(engine, lambda ae: collect(ae, "r", "Hello there"))
    assert [len(output.outputs[0].token_ids) for output in outputs] == list(range(1, 9))
    assert [output.finished for output in outputs] == [False] * 7 + [True]
    assert outputs[-1].outputs[0].token_ids == expected


def test_a_request_joins_the_running_batch_and_finishes_first(engine):
    async def scenario(async_engine):
        finished_order = []
        long_params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

        async def long():
            async for output in async_engine.generate("long", "A long one", long_params):
                if len(output.outputs[0].token_ids) == 3:
                    started.set()
            finished_order.append("long")

        async def short():
            await started.wait()
            await collect(async_engine, "short", "Short", SamplingParams(temperature=0, max_tokens=2))
            finished_order.append("short")

        started = asyncio.Event()
        await asyncio.gather(long(), short())
        return finished_order

    assert run_with(engine, scenario) == ["short", "long"]


@pytest.mark.parametrize(
    ("prompt", "error"), [("", InvalidRequest), ("x" * 5000, PromptTooLong)], ids=["empty", "too long"]
)
def test_bad_input_raises_before_the_first_output(engine, prompt, error):
    async def scenario(async_engine):
        with pytest.raises(error):
            await anext(async_engine.generate("bad", prompt, GREEDY))
        return async_engine.num_in_flight

    assert run_with(engine, scenario) == 0


def test_closing_the_stream_early_aborts_and_frees_the_blocks_at_once(engine):
    async def scenario(async_engine):
        stream = async_engine.generate("left", "Going away", SamplingParams(max_tokens=500, ignore_eos=True))
        await anext(stream)
        await anext(stream)
        assert async_engine.stats().kv_usage > 0
        await stream.aclose()
        await until_idle(async_engine)

    run_with(engine, scenario)


def test_cancelling_the_consumer_aborts_the_request(engine):
    async def scenario(async_engine):
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        consumer = asyncio.create_task(collect(async_engine, "cancelled", "Cancel me", params))
        while async_engine.stats().num_running == 0:
            await asyncio.sleep(0.01)
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        await until_idle(async_engine)

    run_with(engine, scenario)


def test_abort_ends_the_consumer_with_request_aborted(engine):
    async def scenario(async_engine):
        stream = async_engine.generate("aborted", "Abort me", SamplingParams(max_tokens=500, ignore_eos=True))
        await anext(stream)
        async_engine.abort("aborted")
        with pytest.raises(RequestAborted):
            async for _ in stream:
                pass

    run_with(engine, scenario)


def test_shutdown_lets_short_requests_finish_and_aborts_the_rest(engine):
    async def main():
        async_engine = AsyncEngine(engine)
        await async_engine.start()
        short = asyncio.create_task(collect(async_engine, "short", "Quick", GREEDY))
        endless = asyncio.create_task(
            collect(async_engine, "endless", "Slow", SamplingParams(max_tokens=900, ignore_eos=True))
        )
        # Until the endless one decodes (asked between steps); polling "2 running" raced the short one's 8 steps.
        while not await async_engine.call(
            lambda: "endless" in engine.requests and engine.requests["endless"].seqs[0].num_output_tokens > 0
        ):
            await asyncio.sleep(0.01)
        # The short one has at most 7 steps left (~5 ms here); the endless one ~900 (~0.5 s at ~0.55 ms a step,
        # which a 0.5 s drain once let it finish on CI). 0.15 s leaves both sides a wide margin.
        await async_engine.shutdown(drain_timeout=0.15)
        with pytest.raises(EngineNotRunning):
            await anext(async_engine.generate("late", "Too late", GREEDY))
        return await asyncio.gather(short, endless, return_exceptions=True)

    short, endless = asyncio.run(main())
    assert short[-1].finished and len(short[-1].outputs[0].token_ids) == 8
    assert isinstance(endless, RequestAborted)
    assert not engine.has_unfinished_requests() and engine.stats().kv_usage == 0


def test_a_failing_step_fails_the_requests_in_flight_and_the_loop_keeps_serving(engine, monkeypatch):
    real_step = engine.step
    calls = 0

    def step_that_fails_once():
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("device fell over")
        return real_step()

    monkeypatch.setattr(engine, "step", step_that_fails_once)

    async def scenario(async_engine):
        with pytest.raises(EngineStepFailed, match="device fell over"):
            await collect(async_engine, "unlucky", "Fail me")
        stats = async_engine.stats()  # what /metrics reads: nothing running or held once the request failed
        assert stats.num_running == 0 and stats.kv_usage == 0
        return await collect(async_engine, "lucky", "Fine")

    outputs = run_with(engine, scenario)
    assert outputs[-1].finished


def test_an_engine_built_on_an_engine_thread_is_stepped_there_and_the_thread_outlives_one_loop():
    # serve builds its engine on the thread that steps it (torch's OpenMP runs slower on any other thread)
    engine_thread = EngineThread()
    built_on = {}

    def build():
        built_on["thread"] = threading.get_ident()
        return Engine(EngineConfig(model=TINY_MODEL, device="cpu", cache=CacheConfig(num_blocks=64)))

    engine = engine_thread.submit(build).result()

    async def main():
        async_engine = AsyncEngine(engine, engine_thread)
        await async_engine.start()
        try:
            tokens = [out async for out in async_engine.generate("r1", "Hello", GREEDY)][-1].outputs[0].token_ids
            stepped_on = await async_engine.run_on_engine_thread(threading.get_ident)
        finally:
            await async_engine.shutdown(drain_timeout=5)
        return tokens, stepped_on

    tokens, stepped_on = asyncio.run(main())
    assert stepped_on == built_on["thread"] == engine_thread.thread.ident and len(tokens) == 8
    assert engine_thread.thread.is_alive()  # the caller's thread is not closed by shutdown
    assert engine_thread.submit(lambda: engine.has_unfinished_requests()).result() is False
    engine_thread.close()
    engine_thread.thread.join(5)
    assert not engine_thread.thread.is_alive()
