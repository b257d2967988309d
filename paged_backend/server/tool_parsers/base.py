"""What every tool-call format shares: the results, the per-format parser contract, and streaming by diffing.

A format only says where the content ends and where its call objects start (`ToolParser.locate`); turning that
into whole calls, or into OpenAI stream deltas as the text grows, is the same for all of them.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from paged_backend.server.tool_parsers.json_scan import MalformedToolCall, ScannedObject


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_tool_call_id)

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    content: str | None  # the text outside the calls
    tool_calls: list[ToolCall]
    complete: bool = True  # False: the output ended inside a call (max_tokens), whose arguments are cut short


@dataclass
class ToolCallDelta:
    """One streamed piece of call `index`: the first carries id and name, every one an arguments fragment."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def __add__(self, other: StreamDelta) -> StreamDelta:
        return StreamDelta(self.content + other.content, self.tool_calls + other.tool_calls)


@dataclass
class PartialCall:
    name: str | None  # known once the name's string has closed
    arguments: str | None  # the arguments' JSON text so far; only ever grows


class ToolParser(ABC):
    """One model family's way of writing tool calls into its text (`--tool-call-parser NAME`)."""

    name: ClassVar[str]
    argument_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")
    # Its markers are special tokens: the text must be detokenized with them, or the calls cannot be found.
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def locate(self, text: str, final: bool) -> tuple[int, list[ScannedObject]]:
        """Where the content ends and the call objects begun so far. While streaming (`final` False) the content
        end holds back anything that may still turn into a marker. Raises MalformedToolCall."""

    def parse(self, text: str, final: bool) -> tuple[int, list[PartialCall]]:
        content_end, objects = self.locate(text, final)
        return content_end, [self._call(text, scanned, final) for scanned in objects]

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a finished output; text that is not well-formed calls stays content, as vLLM answers."""
        try:
            content_end, calls = self.parse(text, final=True)
        except MalformedToolCall:
            return ExtractedToolCalls(text, [])
        if not calls:
            return ExtractedToolCalls(text, [])
        content = text[:content_end]
        return ExtractedToolCalls(content if content.strip() else None, [ToolCall(c.name, c.arguments) for c in calls])

    def _call(self, text: str, scanned: ScannedObject, final: bool) -> PartialCall:
        if final:
            _check_complete_call(text, scanned)
        name_span = scanned.fields.get("name")
        name = None
        if name_span is not None and name_span.end is not None:
            name = json.loads(text[name_span.start : name_span.end])
            if not isinstance(name, str):
                raise MalformedToolCall(f"a tool call's name must be a string, got {name!r}")
        key = next((key for key in self.argument_keys if key in scanned.fields), None)
        if key is None:
            return PartialCall(name, "{}" if scanned.end is not None else None)
        span = scanned.fields[key]
        raw = text[span.start : span.end]
        if text[span.start] == '"':  # arguments written as a JSON-encoded string: send its contents once whole
            return PartialCall(name, json.loads(raw) if span.end is not None else None)
        return PartialCall(name, raw)


def _check_complete_call(text: str, scanned: ScannedObject) -> None:
    if scanned.end is None:
        raise MalformedToolCall("the output ended inside a tool call")
    try:
        call = json.loads(text[scanned.start : scanned.end])
    except ValueError as error:
        raise MalformedToolCall(f"a tool call is not valid JSON: {error}") from error
    if not isinstance(call.get("name"), str):
        raise MalformedToolCall("a tool call has no string 'name'")


def partial_marker_length(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker` (held back while streaming).

    >>> partial_marker_length("see <tool_", "<tool_call>")
    6
    """
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
