"""The tools a chat request offers and how the model may use them, checked at the edge (pure).

    tools                FunctionTool(name, description, parameters): a JSON Schema object as
                         JSON text ("" for a function without parameters)
    tool_choice          auto (the default) | none | required | function NAME
    parallel_tool_calls  several calls in one answer (default) or at most one

Checked once here for both APIs, each bad field named as the gRPC API writes it
(`tools[1].parameters`, `tool_choice.function_name`, `messages[2].tool_calls[0].arguments`;
the HTTP API maps the names back to OpenAI's), so a bad request is refused before a stream
opens. The tokenizer parses the same JSON again when it renders the prompt: it owns the
template, this only guards the door.

What each choice does to the output (services/frontend/chat_output.py, tool_grammar.py):

    auto       <tool_call> blocks the model writes are parsed into calls
    none       the tools are still listed in the prompt; nothing is parsed (blocks stay text)
    required   a constraint makes the answer one or more calls of the offered tools
    function   the same, of the one named function
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from mili.text import strict_json

# OpenAI's rule for function names (services/tokenizer/tools.py applies the same one).
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The keys of OpenAI's function object that reach the prompt (the tokenizer's FUNCTION_KEYS).
FUNCTION_KEYS = ("name", "description", "parameters", "strict")

ToolChoiceMode = Literal["auto", "none", "required", "function"]
TOOL_CHOICE_MODES: tuple[str, ...] = get_args(ToolChoiceMode)

Bad = Callable[[str, object, str], None]


@dataclass(frozen=True)
class FunctionTool:
    """A function the model may call."""

    name: str
    description: str = ""
    parameters: str = ""  # a JSON Schema object, as JSON text; "" when it takes none
    strict: bool | None = None  # OpenAI's flag, only shown in the prompt; None: unset
    # The function object's keys in the caller's order, for the prompt to list them as HF
    # renders the caller's dict (chat.proto's Tool.function_keys); (): the default order.
    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class ToolCallInput:
    """A call an earlier assistant turn made, as the caller sends it back."""

    id: str
    name: str
    arguments: str  # a JSON object, as JSON text


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode = "auto"
    function_name: str = ""  # mode "function" only

    def __post_init__(self) -> None:
        if self.mode not in TOOL_CHOICE_MODES:
            raise ValueError(f"tool choice must be one of {TOOL_CHOICE_MODES}, got {self.mode!r}")

    @property
    def is_forced(self) -> bool:
        """The answer must be a call (enforced with a constraint)."""
        return self.mode in ("required", "function")


AUTO = ToolChoice()  # the default


def parse_object(text: str) -> dict[str, Any] | None:
    """`text` as a JSON object (mili.text.strict_json), or None when it is not one."""
    try:
        value = strict_json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def check_tools(tools: Sequence[FunctionTool], choice: ToolChoice, is_chat: bool, bad: Bad) -> None:
    """Report every bad tool and a tool choice that names no offered tool through `bad`."""
    if tools and not is_chat:
        bad("tools", f"{len(tools)} tools", "tools need a chat: set messages")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if not _NAME.fullmatch(tool.name):
            bad(f"tools[{i}].name", tool.name, "must be 1 to 64 letters, digits, '_' or '-'")
        elif tool.name in names:
            bad(f"tools[{i}].name", tool.name, "two tools have this name")
        names.add(tool.name)
        if tool.parameters:
            _check_parameters(tool.parameters, f"tools[{i}].parameters", bad)
    if choice.is_forced and not tools:
        bad("tool_choice", choice.mode, f"tool_choice {choice.mode} needs tools")
    elif choice.mode == "function" and choice.function_name not in names:
        offered = ", ".join(sorted(names))
        bad("tool_choice.function_name", choice.function_name, f"not an offered tool ({offered})")
    elif choice.mode != "function" and choice.function_name:
        bad("tool_choice.function_name", choice.function_name, "only for tool_choice function")


def _check_parameters(text: str, field: str, bad: Bad) -> None:
    schema = parse_object(text)
    if schema is None:
        bad(field, text, "must be a JSON Schema object, in JSON text")
    elif schema.get("type", "object") != "object":  # none: an object (tool_grammar.py says so)
        bad(field, text, "a function's parameters are a schema of type object")


def check_tool_calls(calls: Sequence[ToolCallInput], role: str, field: str, bad: Bad) -> None:
    """The calls an earlier turn made (`field`: "messages[i].tool_calls")."""
    if calls and role != "assistant":
        bad(field, f"{len(calls)} calls", "only assistant turns carry tool calls")
    for j, call in enumerate(calls):
        if not call.name:
            bad(f"{field}[{j}].name", call.name, "required: the called function's name")
        if parse_object(call.arguments) is None:
            bad(f"{field}[{j}].arguments", call.arguments, "must be a JSON object")


def num_chars(tools: Sequence[FunctionTool], calls: Sequence[ToolCallInput]) -> int:
    """Characters the tokenizer counts against its input limit for these tools and calls."""
    return sum(len(t.name) + len(t.description) + len(t.parameters) for t in tools) + sum(
        len(c.id) + len(c.name) + len(c.arguments) for c in calls
    )
