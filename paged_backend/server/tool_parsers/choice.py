"""What a request's `tools` / `tool_choice` mean for one generation: a constraint, and a reader per choice.

- none: plain text (the tools still reach the chat template, as in vLLM).
- auto: the server's `--tool-call-parser` reads calls out of free text; needs `--enable-auto-tool-choice`.
- required / a named function: structured outputs force the call, so it always validates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged_backend.errors import InvalidRequest
from paged_backend.server.tool_parsers.forced import named_call_schema, required_calls_schema, required_calls_stream
from paged_backend.server.tool_parsers.registry import get_tool_parser
from paged_backend.server.tool_parsers.stream import NamedToolCallStream, ParsedToolCallStream
from paged_backend.structured.params import StructuredOutputsParams

ToolCallReader = ParsedToolCallStream | NamedToolCallStream


@dataclass
class ToolCallPlan:
    mode: str  # none | auto | required | named
    structured_outputs: StructuredOutputsParams | None = None
    parser_name: str | None = None
    function_name: str | None = None  # the named choice's function
    parallel: bool = True

    def reader(self) -> ToolCallReader | None:
        """A fresh reader for one choice's output; None when calls are not read (tool_choice none)."""
        if self.mode == "auto":
            return ParsedToolCallStream(get_tool_parser(self.parser_name), None if self.parallel else 1)
        if self.mode == "required":
            return required_calls_stream(self.parallel)
        if self.mode == "named":
            return NamedToolCallStream(self.function_name)
        return None

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the parser's markers are special tokens the detokenizer must keep (Mistral's [TOOL_CALLS])."""
        return self.mode == "auto" and get_tool_parser(self.parser_name).keeps_special_tokens

    def finish_reason(self, engine_reason: str | None, called: bool, complete: bool = True) -> str | None:
        """ "tool_calls" once whole calls were made and the model stopped by itself; a named choice ends as the
        engine did (vLLM's rule), and so does an output cut off inside a call: "length" tells the client the
        arguments are cut short (OpenAI's and vLLM's answer), streamed or not."""
        if engine_reason == "stop" and called and complete and self.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason


def plan_tool_calls(
    functions: dict[str, dict[str, Any] | None],
    tool_choice: str | dict | None,
    parallel_tool_calls: bool | None,
    *,
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
) -> ToolCallPlan:
    """`functions`: each tool's name -> its parameters schema. `tool_choice` as sent (a string or the named
    object's `function.name` already pulled out as `{"name": ...}`); null picks OpenAI's default."""
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return ToolCallPlan("none")
    if not functions:
        raise InvalidRequest(f"tool_choice {_show(tool_choice)} needs 'tools' to choose from; send tools or drop it")
    if tool_choice == "auto":
        if not (enable_auto_tool_choice and tool_call_parser):
            raise InvalidRequest(
                'tool_choice "auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser '
                'NAME; ask for tool_choice "required", a named function, or "none" instead'
            )
        return ToolCallPlan("auto", parser_name=tool_call_parser, parallel=parallel)
    if tool_choice == "required":
        schema = required_calls_schema(functions, parallel)
        return ToolCallPlan("required", _forced(schema), parallel=parallel)
    name = tool_choice["name"]
    if name not in functions:
        raise InvalidRequest(
            f"tool_choice names function {name!r}, but tools define only: {', '.join(functions)}; name one of them"
        )
    return ToolCallPlan("named", _forced(named_call_schema(functions[name])), function_name=name)


def _forced(schema: dict[str, Any]) -> StructuredOutputsParams:
    # No free whitespace between JSON tokens: arguments come out compact and canonical, and a weak model cannot
    # spend its token budget on blank space.
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def _show(tool_choice: str | dict) -> str:
    return f'"{tool_choice}"' if isinstance(tool_choice, str) else f"naming {tool_choice['name']!r}"
