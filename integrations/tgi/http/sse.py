"""Server-sent events as TGI frames them: `data: <compact json>\n\n`, keep-alive comments every 15 s."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

KEEP_ALIVE_SECONDS = 15.0
KEEP_ALIVE = ":\n\n"
DONE = "data: [DONE]\n\n"


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def with_keep_alive(frames: AsyncIterator[str], interval: float = KEEP_ALIVE_SECONDS) -> AsyncIterator[str]:
    """Forward `frames`, inserting a comment whenever the next one takes longer than `interval`."""
    async with contextlib.aclosing(frames):
        pending = asyncio.ensure_future(anext(frames))
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=interval)
                if not done:
                    yield KEEP_ALIVE
                    continue
                try:
                    frame = pending.result()
                except StopAsyncIteration:
                    return
                yield frame
                pending = asyncio.ensure_future(anext(frames))
        finally:
            # Let the cancelled read finish before `aclosing` closes the generator it was running.
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


def sse_response(frames: AsyncIterator[str], headers: dict[str, str] | None = None) -> StreamingResponse:
    return StreamingResponse(
        with_keep_alive(frames),
        media_type="text/event-stream",
        headers={"X-Accel-Buffering": "no", "Cache-Control": "no-cache", **(headers or {})},
    )
