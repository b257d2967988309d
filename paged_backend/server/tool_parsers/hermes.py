"""Hermes-style calls, as Qwen2.5 and Qwen3 write them: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Content is the text before the first call; text between and after calls is dropped, as in vLLM.
"""

from __future__ import annotations

from paged_backend.server.tool_parsers.base import ToolParser, partial_marker_length
from paged_backend.server.tool_parsers.json_scan import MalformedToolCall, ScannedObject, scan_object, skip_whitespace

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def locate(self, text: str, final: bool) -> tuple[int, list[ScannedObject]]:
        first = text.find(OPEN)
        if first < 0:
            return len(text) - (0 if final else partial_marker_length(text, OPEN)), []
        objects, opened = [], first
        while opened >= 0:
            start = skip_whitespace(text, opened + len(OPEN))
            if start >= len(text):
                if final:
                    raise MalformedToolCall(f"the output ends with an empty {OPEN}")
                break
            if text[start] != "{":
                raise MalformedToolCall(f"{OPEN} must be followed by a JSON object, found {text[start]!r}")
            scanned = scan_object(text, start)
            objects.append(scanned)
            if scanned.end is None:
                break
            closed = skip_whitespace(text, scanned.end)
            if closed >= len(text):
                break  # a missing closing tag at the very end is tolerated (the model stopped there)
            if not text.startswith(CLOSE, closed) and not (not final and CLOSE.startswith(text[closed:])):
                raise MalformedToolCall(f"a tool call's JSON must be followed by {CLOSE}")
            opened = text.find(OPEN, closed + len(CLOSE))
        return first, objects
