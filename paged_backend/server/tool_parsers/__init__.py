"""Tool calling on /v1/chat/completions: parsers for the formats models write calls in (tool_choice="auto"),
and the schemas and readers for calls forced by structured outputs (tool_choice="required" or a named function).
"""

from paged_backend.server.tool_parsers.base import ExtractedToolCalls, StreamDelta, ToolCall, ToolParser
from paged_backend.server.tool_parsers.forced import named_call_schema, required_calls_schema, required_calls_stream
from paged_backend.server.tool_parsers.registry import TOOL_PARSERS, get_tool_parser
from paged_backend.server.tool_parsers.stream import NamedToolCallStream, ParsedToolCallStream

__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "NamedToolCallStream",
    "ParsedToolCallStream",
    "StreamDelta",
    "ToolCall",
    "ToolParser",
    "get_tool_parser",
    "named_call_schema",
    "required_calls_schema",
    "required_calls_stream",
]
