"""Tool calling on TGI's chat route: tools become one JSON grammar, the generated object becomes `tool_calls`.

As in TGI, the model writes `{"function": {"_name": NAME, ...arguments}}`, constrained to the offered functions.
`tool_choice` "auto" (the default with tools) also offers a `no_tool` function whose `content` is a plain answer;
"required" offers only the tools, a named choice only that one, "none" drops the tools altogether.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from paged_backend.tgi.http.errors import ToolError
from paged_backend.tgi.http.grammar import ValidGrammar, validate_grammar

NO_TOOL = "no_tool"
NO_TOOL_FUNCTION = {
    "name": NO_TOOL,
    "description": "Answer in plain text when none of the other functions fits the request.",
    "parameters": {
        "type": "object",
        "properties": {"content": {"type": "string", "description": "The answer to the user."}},
        "required": ["content"],
    },
}
TOOL_CHOICE_FORMS = 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
# Added to the prompt when the chat template cannot render tools itself.
DEFAULT_TOOL_PROMPT = (
    "You can call the functions listed below. Reply with one JSON object that calls the function which best "
    "answers the request, with its arguments filled in."
)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request with tools asks for: the functions offered and the grammar that enforces a call."""

    functions: list[dict]  # OpenAI function objects (name, description, parameters), no_tool included when offered
    grammar: ValidGrammar


def _functions(tools: list[dict]) -> list[dict]:
    functions = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ToolError(f'tools[{index}] must be {{"type": "function", "function": {{"name": ..., ...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(f"tools[{index}].function.name must be a non-empty string")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise ToolError(f"tools[{index}].function.parameters must be a JSON schema object")
        functions.append({**function, "parameters": parameters})
    names = [function["name"] for function in functions]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ToolError(f"tool names must be unique; repeated: {', '.join(duplicates)}")
    return functions


def _chosen(functions: list[dict], tool_choice: Any) -> list[dict] | None:
    """The functions the grammar offers; None when tool_choice is "none"."""
    if tool_choice is None or tool_choice == "auto":
        return [*functions, NO_TOOL_FUNCTION]
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return functions
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ToolError(TOOL_CHOICE_FORMS)
    elif isinstance(tool_choice, str):
        name = tool_choice  # TGI also takes a bare function name
    else:
        raise ToolError(TOOL_CHOICE_FORMS)
    named = [function for function in functions if function["name"] == name]
    if not named:
        offered = ", ".join(function["name"] for function in functions)
        raise ToolError(f"Tool with name {name} not found; the request offers: {offered}")
    return named


def _call_schema(function: dict, definitions: dict) -> dict:
    """`{"_name": NAME, ...arguments}` for one function; its `$defs` move to the grammar's root, where refs point."""
    parameters = dict(function["parameters"])
    for key in ("$defs", "definitions"):
        for name, schema in (parameters.pop(key, None) or {}).items():
            if definitions.setdefault(key, {}).setdefault(name, schema) != schema:
                raise ToolError(f"tools define {key}/{name} differently; give shared definitions one meaning")
    properties = {"_name": {"type": "string", "const": function["name"]}, **(parameters.pop("properties", {}))}
    required = ["_name", *[r for r in parameters.pop("required", []) if r != "_name"]]
    parameters.pop("type", None)
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": parameters.pop("additionalProperties", False),
        **parameters,
    }


def plan_tools(tools: list[dict] | None, tool_choice: Any) -> ToolPlan | None:
    """The grammar for `tools` under `tool_choice`; None when no tool may be called."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs `tools`: give the functions the model may call")
        return None
    offered = _chosen(_functions(tools), tool_choice)
    if offered is None:
        return None
    definitions: dict = {}
    calls = [_call_schema(function, definitions) for function in offered]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {
        "type": "object",
        "properties": {"function": call},
        "required": ["function"],
        "additionalProperties": False,
        **definitions,
    }
    return ToolPlan(offered, validate_grammar("json", schema))


def tool_prompt_text(plan: ToolPlan, tool_prompt: str | None) -> str:
    """The instruction and the functions as JSON, for templates that do not render `tools` themselves."""
    tools = [{"type": "function", "function": function} for function in plan.functions]
    return f"{tool_prompt or DEFAULT_TOOL_PROMPT}\n{json.dumps(tools)}"


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    tool_calls: list[dict] | None


def parse_reply(text: str) -> ParsedReply:
    """The grammar-shaped reply as OpenAI's message: a tool call, or `no_tool`'s content as plain text.

    Text that is not a complete call (generation hit its length limit) comes back as content, unchanged.
    """
    try:
        call = json.loads(text)["function"]
        name = call.pop("_name")
    except (ValueError, KeyError, TypeError, AttributeError):
        return ParsedReply(text, None)
    if name == NO_TOOL:
        return ParsedReply(str(call.get("content", "")), None)
    function = {"name": name, "arguments": json.dumps(call), "description": None}
    return ParsedReply(None, [{"id": "0", "type": "function", "function": function}])
