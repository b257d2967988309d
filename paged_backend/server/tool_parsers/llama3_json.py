"""Llama 3.1 / 3.2 JSON calls: `{"name": ..., "parameters": {...}}`, possibly after `<|python_tag|>`, several
joined by `;`. Only an output that starts with the tag or a `{` is taken as calls; anything else is content.
"""

from __future__ import annotations

from paged_backend.server.tool_parsers.base import ToolParser
from paged_backend.server.tool_parsers.json_scan import (
    MalformedToolCall,
    ScannedObject,
    scan_objects,
    skip_whitespace,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def locate(self, text: str, final: bool) -> tuple[int, list[ScannedObject]]:
        start = skip_whitespace(text, 0)
        tagged = text.startswith(PYTHON_TAG, start)
        if tagged:
            start = skip_whitespace(text, start + len(PYTHON_TAG))
        elif not final and start < len(text) and PYTHON_TAG.startswith(text[start:]):
            return 0, []  # may still become the tag
        if start >= len(text):
            if tagged and final:
                raise MalformedToolCall(f"the output ends right after {PYTHON_TAG}")
            return (0 if tagged or not final else len(text)), []
        if text[start] != "{":
            if tagged:
                raise MalformedToolCall(f"{PYTHON_TAG} must be followed by a JSON object")
            return len(text), []
        objects, stopped = scan_objects(text, start, ";")
        if final and skip_whitespace(text, stopped) < len(text):
            raise MalformedToolCall("text follows the tool calls")
        return 0, objects
