"""OpenAI's tool parameters -> the frontend's tool types (services/frontend/tools.py).

    tools                [{"type": "function", "function": {"name", "description"?,
                           "parameters"?, "strict"?}}] (type may be left out, as vLLM
                           defaults it)
    tool_choice          "auto" | "none" | "required" | {"type": "function",
                           "function": {"name"}} (type likewise)
    parallel_tool_calls  true (default) | false
    messages[i]          assistant: "tool_calls": [{"id", "type": "function",
                           "function": {"name", "arguments": JSON text}}], content may be null;
                         tool: "tool_call_id" and the result in content

Types are checked here, naming OpenAI's parameter; what the values mean (names, schemas, the
chosen function being offered) is validation's (tools.check_tools), whose field names `param`
maps back (`tools[0].parameters` -> `tools[0].function.parameters`). `strict` is accepted and
only reaches the prompt (Qwen3's template writes each tool dict as sent, as HF renders it, key
order and an empty description included): calls are parsed the same way, and enforced only
with tool_choice required or a named function.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mili.errors import InvalidArgument
from services.frontend.http_api.body import Body
from services.frontend.tools import AUTO, FUNCTION_KEYS, FunctionTool, ToolCallInput, ToolChoice

_MODES = ("auto", "none", "required")


def tools_of(body: Body) -> tuple[FunctionTool, ...]:
    tools = body.array("tools") or []
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        # A tool without its type is a function, as vLLM reads it (its type's default)
        if not isinstance(tool, dict) or tool.get("type") not in (None, "function"):
            raise InvalidArgument(f"{where}.type", tool, 'each tool must be {"type": "function"}')
        function = Body(tool, where).object("function")
        if function is None:
            raise InvalidArgument(f"{where}.function", None, "required")
        parameters = function.object("parameters")
        out.append(
            FunctionTool(
                name=function.text("name") or "",
                description=function.text("description") or "",
                parameters="" if parameters is None else json.dumps(parameters.data),
                strict=function.flag("strict"),  # shown in the prompt; enforcing is tool_choice's
                # The prompt lists them as HF renders this dict: in its order, "" shown.
                keys=tuple(
                    k for k, v in function.data.items() if k in FUNCTION_KEYS and v is not None
                ),
            )
        )
    return tuple(out)


def tool_choice_of(body: Body) -> ToolChoice:
    choice = body.raw("tool_choice")
    if choice is None:
        return AUTO
    if isinstance(choice, str) and choice in _MODES:
        return ToolChoice(choice)  # type: ignore[arg-type]
    if isinstance(choice, dict) and choice.get("type") in (None, "function"):
        function = Body(choice, "tool_choice").object("function")
        name = function.text("name") if function is not None else None
        if name:
            return ToolChoice("function", name)
    raise InvalidArgument(
        "tool_choice",
        choice,
        'must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
    )


def parallel_of(body: Body) -> bool:
    flag = body.flag("parallel_tool_calls")
    return True if flag is None else flag


def tool_calls_of(message: Body) -> tuple[ToolCallInput, ...]:
    """An assistant message's `tool_calls`; arguments as JSON text (an object is taken too)."""
    calls = message.array("tool_calls") or []
    out = []
    for j, call in enumerate(calls):
        where = message.name(f"tool_calls[{j}]")
        if not isinstance(call, dict):
            raise InvalidArgument(where, call, "must be an object")
        function = Body(call, where).object("function")
        if function is None:
            raise InvalidArgument(f"{where}.function", None, "required")
        arguments = function.raw("arguments")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments)
        elif not isinstance(arguments, str):
            raise function.wrong("arguments", arguments, "a string of JSON")
        call_id = Body(call, where).text("id") or ""
        out.append(ToolCallInput(call_id, function.text("name") or "", arguments))
    return tuple(out)


_TOOL_FIELD = re.compile(r"tools\[(\d+)\]\.(name|parameters)")
_CALL_FIELD = re.compile(r"(messages\[\d+\]\.tool_calls\[\d+\])\.(name|arguments)")


def param(field: str) -> str | None:
    """Validation's name of a tool field as OpenAI's parameter; None for other fields."""
    if field.startswith("tool_choice"):
        return "tool_choice"
    found = _TOOL_FIELD.fullmatch(field)
    if found:
        return f"tools[{found.group(1)}].function.{found.group(2)}"
    found = _CALL_FIELD.fullmatch(field)
    if found:
        return f"{found.group(1)}.function.{found.group(2)}"
    return None


def message_fields(message: Body) -> dict[str, Any]:
    """ChatTurn's tool fields of one message: its calls (assistant) or the call it answers."""
    return {
        "tool_calls": tool_calls_of(message),
        "tool_call_id": message.text("tool_call_id") or "",
    }
