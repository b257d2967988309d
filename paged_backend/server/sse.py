"""Server-sent events: chat and completions stream `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`; the
Responses and Messages APIs stream named events (`event: <type>` before each `data:`) and no `[DONE]`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from paged_backend.server.openai_errors import engine_error

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer the stream


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def named_event(payload: dict) -> bytes:
    """An event named by its payload's `type`. ASCII JSON: a lone surrogate echoed back cannot break the encoding."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def _openai_error(status_code: int, body: dict) -> dict:
    return body


async def event_stream(
    chunks: AsyncIterator[dict],
    *,
    encode: Callable[[dict], bytes] = event,
    error_payload: Callable[[int, dict], dict] = _openai_error,
    end: bytes | None = DONE,
) -> AsyncIterator[bytes]:
    """Encode chunks as events; an error after the headers went out travels as a last error event (its payload made
    by `error_payload` from the status and OpenAI's error body), then `end`."""
    try:
        async for chunk in chunks:
            yield encode(chunk)
    except Exception as error:
        status_code, body = engine_error(error)
        if status_code == 500:  # a bug or a failed step; aborts and bad input are expected
            logger.exception("stream failed")
        yield encode(error_payload(status_code, body))
    if end is not None:
        yield end
