"""Tool-call parsers by their `--tool-call-parser` name (vLLM's names)."""

from __future__ import annotations

from paged_backend.errors import InvalidRequest
from paged_backend.server.tool_parsers.base import ToolParser
from paged_backend.server.tool_parsers.hermes import HermesToolParser
from paged_backend.server.tool_parsers.llama3_json import Llama3JsonToolParser
from paged_backend.server.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser `--tool-call-parser NAME` names.

    >>> get_tool_parser("hermes").name
    'hermes'
    """
    if name not in TOOL_PARSERS:
        raise InvalidRequest(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
