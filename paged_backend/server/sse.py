"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from paged_backend.server.openai_errors import engine_error

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer the stream


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def event_stream(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Encode chunks as events; an error after the headers went out travels as a last error event."""
    try:
        async for chunk in chunks:
            yield event(chunk)
    except Exception as error:
        status_code, body = engine_error(error)
        if status_code == 500:  # a bug or a failed step; aborts and bad input are expected
            logger.exception("stream failed")
        yield event(body)
    yield DONE
