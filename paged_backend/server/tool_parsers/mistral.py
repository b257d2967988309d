"""Mistral calls: `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`.

`JsonArrayToolParser` without a marker also reads tool_choice="required" outputs, which are constrained to the
same array (see forced.py).
"""

from __future__ import annotations

from typing import ClassVar

from paged_backend.server.tool_parsers.base import ToolParser, partial_marker_length
from paged_backend.server.tool_parsers.json_scan import (
    MalformedToolCall,
    ScannedObject,
    scan_objects,
    skip_whitespace,
)


class JsonArrayToolParser(ToolParser):
    """Calls as a JSON array after `marker`; with no marker the whole output is the array."""

    name = "json_array"
    marker: ClassVar[str] = ""

    def locate(self, text: str, final: bool) -> tuple[int, list[ScannedObject]]:
        first = text.find(self.marker)
        if first < 0:
            return len(text) - (0 if final else partial_marker_length(text, self.marker)), []
        start = skip_whitespace(text, first + len(self.marker))
        if start >= len(text):
            if final:
                raise MalformedToolCall("the output ends before its array of tool calls")
            return first, []
        if text[start] != "[":
            raise MalformedToolCall(f"tool calls must be a JSON array, found {text[start]!r}")
        objects, stopped = scan_objects(text, start + 1, ",")
        if final and (text[stopped : stopped + 1] != "]" or skip_whitespace(text, stopped + 1) < len(text)):
            raise MalformedToolCall("the array of tool calls is not closed, or text follows it")
        return first, objects


class MistralToolParser(JsonArrayToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    keeps_special_tokens = True  # [TOOL_CALLS] is a special token in Mistral's tokenizers
