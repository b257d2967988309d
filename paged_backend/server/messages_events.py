"""Anthropic's server-sent events: `event: <type>` and `data: {json}` per event, and content blocks built from
the text and tool calls a generation streams.

A stream runs message_start, ping, then per block content_block_start, content_block_delta... and
content_block_stop, then message_delta (stop_reason, usage) and message_stop. A failure after the headers went out
travels as a last `error` event in Anthropic's error shape.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from paged_backend.server import sse
from paged_backend.server.openai_errors import anthropic_error_body
from paged_backend.server.tool_parsers import StreamDelta


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex}"


def event_stream(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Anthropic's named events; an error raised while they are produced ends the stream with an `error` event."""
    return sse.event_stream(
        events,
        encode=sse.named_event,
        end=None,
        error_payload=lambda status, body: anthropic_error_body(body["error"]["message"], status),
    )


class ContentBlocks:
    """Opens, fills and closes content blocks as a reader's pieces arrive: text goes into a text block, each tool
    call into a tool_use block of its own (its arguments as `input_json_delta` fragments)."""

    def __init__(self) -> None:
        self.count = 0  # blocks started so far; the open one, if any, is the last
        self._open: str | int | None = None  # "text", or the reader's index of the call being streamed

    def events(self, piece: StreamDelta) -> list[dict]:
        events = []
        if piece.content:
            if self._open != "text":
                events += self._start({"type": "text", "text": ""}, "text")
            events.append(self._delta({"type": "text_delta", "text": piece.content}))
        for call in piece.tool_calls:
            if call.id is not None:  # a call's first piece names it
                block = {"type": "tool_use", "id": new_tool_use_id(), "name": call.name, "input": {}}
                events += self._start(block, call.index)
            if call.arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return events

    def close(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self.count - 1}]

    def _start(self, block: dict, kind: str | int) -> list[dict]:
        events = self.close()
        events.append({"type": "content_block_start", "index": self.count, "content_block": block})
        self.count, self._open = self.count + 1, kind
        return events

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.count - 1, "delta": delta}
