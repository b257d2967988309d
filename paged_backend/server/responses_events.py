"""Output items built from the model's text as it grows, and the typed stream events that say so, in OpenAI's order.

    response.created, response.in_progress,
    per message item: output_item.added, content_part.added, output_text.delta..., output_text.done,
                      content_part.done, output_item.done
    per function_call item: output_item.added, function_call_arguments.delta..., function_call_arguments.done,
                            output_item.done
    response.completed | response.incomplete | response.failed

Every event carries a `sequence_number`. A response that is not streamed is built by the same `OutputAssembler`
(its events dropped), so both forms of one answer hold the same items.
"""

from __future__ import annotations

import copy
from typing import Any

from paged_backend.server.generation import Usage
from paged_backend.server.responses_objects import ResponseRecord, new_id
from paged_backend.server.tool_parsers import StreamDelta

TERMINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete"}


class OutputAssembler:
    """Turns the parsed pieces of one output (text and tool-call deltas) into `record.output` and events."""

    def __init__(self, record: ResponseRecord) -> None:
        self.record = record
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the item being written; at most one at a time
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index (the reader's) -> its item

    def start(self) -> list[dict[str, Any]]:
        return [self._response_event("response.created"), self._response_event("response.in_progress")]

    def feed(self, piece: StreamDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if piece.content:
            if self._open is None or self._open["type"] != "message":
                events += self._close("completed") + self._open_message()
            part = self._open["content"][0]
            part["text"] += piece.content
            events.append(self._text_event("response.output_text.delta", self._open, delta=piece.content, logprobs=[]))
        for delta in piece.tool_calls:
            if delta.id is not None:
                events += self._close("completed") + self._open_call(delta.index, delta.name)
            item = self._calls[delta.index]
            item["arguments"] += delta.arguments
            if delta.arguments:
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self._index(item), delta=delta.arguments))  # fmt: skip
        return events

    def finish(self, status: str, usage: Usage | None, incomplete_reason: str | None = None) -> list[dict[str, Any]]:
        """Close what is open (an output with no item gets an empty message, as OpenAI's always has one)."""
        item_status = "incomplete" if status == "incomplete" else "completed"
        events = [] if self.record.output else self._open_message()
        events += self._close(item_status)
        self.record.finish(status, usage, incomplete_reason)
        return events + [self._response_event(TERMINAL_EVENTS[status])]

    def fail(self, code: str, message: str) -> list[dict[str, Any]]:
        self.record.fail(code, message)
        return [self._response_event("response.failed")]

    def _open_message(self) -> list[dict[str, Any]]:
        item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        self._open = item
        self.record.output.append(item)
        part = {"type": "output_text", "text": "", "annotations": []}
        added = self._item_event("response.output_item.added", item)
        item["content"].append(part)
        return [added, self._text_event("response.content_part.added", item, part=copy.deepcopy(part))]

    def _open_call(self, index: int, name: str | None) -> list[dict[str, Any]]:
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": new_id("call"),
                "name": name or "", "arguments": ""}  # fmt: skip
        self._open, self._calls[index] = item, item
        self.record.output.append(item)
        return [self._item_event("response.output_item.added", item)]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        if item["type"] == "function_call":
            done = self._event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=self._index(item), arguments=item["arguments"])  # fmt: skip
            return [done, self._item_event("response.output_item.done", item)]
        part = item["content"][0]
        return [self._text_event("response.output_text.done", item, text=part["text"], logprobs=[]),
                self._text_event("response.content_part.done", item, part=copy.deepcopy(part)),
                self._item_event("response.output_item.done", item)]  # fmt: skip

    def _index(self, item: dict[str, Any]) -> int:
        return next(index for index, candidate in enumerate(self.record.output) if candidate is item)

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _item_event(self, type_: str, item: dict[str, Any]) -> dict[str, Any]:
        return self._event(type_, output_index=self._index(item), item=copy.deepcopy(item))

    def _text_event(self, type_: str, item: dict[str, Any], **fields: Any) -> dict[str, Any]:
        return self._event(type_, item_id=item["id"], output_index=self._index(item), content_index=0, **fields)

    def _response_event(self, type_: str) -> dict[str, Any]:
        return self._event(type_, response=self.record.as_dict())
