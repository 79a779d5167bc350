"""tool_choice required / a named function -> the Constraint that makes the answer a valid call.

Qwen3 calls a tool by writing, after any thinking, one block per call:

    <think>\\n...\\n</think>\\n\\n                       (thinking on: optional, any text)
    <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    \\n<tool_call>\\n...\\n</tool_call>                  (more calls: parallel_tool_calls)

The constraint is a grammar in llguidance's Lark dialect (the `grammar` kind of
mili.engine.constraint.spec) that accepts exactly that: each call's JSON is an embedded JSON
Schema (`%json`), `{"name": <one of the offered names>, "arguments": <that tool's parameters>}`,
written with Qwen3's own separators (", " and ": ", as its template's `tojson` renders calls
back) and no other whitespace. `<tool_call>` and `</tool_call>` are single tokens of Qwen3's
vocabulary (llguidance treats them as special: the grammar names them bare,
so the model must write the token, as it does, not the tag spelled in pieces).

Thinking. With thinking on (enable_thinking unset or true) the model thinks before it calls:
as for any constraint of a chat request, the frontend puts a think block of any text before
the calls (prompt.with_think_block, mili.engine.constraint.think), so the constraint leaves
the reasoning alone and a call still always follows. With thinking off the template has
closed an empty think block in the prompt and the answer is the calls alone.

Objects in the schemas are closed (mili.engine.constraint.schema.close_objects: no keys
beyond those listed) as for a json_schema constraint, so bounded parameters give bounded
calls. Pure: builds text; prefill and decode compile it like any grammar.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance

from mili.engine.constraint.schema import (
    close_objects,
    rebase_refs,
    reword,
    unenforced_bounds,
)
from mili.engine.constraint.spec import MAX_JSON_DEPTH, Constraint, json_depth, validate
from mili.errors import InvalidArgument
from services.frontend.tools import FunctionTool, ToolChoice, parse_object

# How a call's JSON is written: Qwen3's separators, no free whitespace (a sampler could
# otherwise write blanks forever); unknown keywords refused, not ignored.
CALL_JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
    "coerce_one_of": False,
}
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def call_schema(tool: FunctionTool) -> dict[str, Any]:
    """The JSON Schema of one call of `tool`: {"name": its name, "arguments": its parameters}."""
    parameters = parse_object(tool.parameters) if tool.parameters else None
    if parameters is None:
        parameters = _NO_PARAMETERS
    elif "type" not in parameters:
        # Without a type a schema allows any JSON value, and arguments that are not an object
        # are no call (chat_output.py leaves the block as text). tools.py reads a missing type
        # as object and refuses any other, so this only states what was meant.
        parameters = {"type": "object", **parameters}
    arguments = close_objects(parameters)
    arguments = rebase_refs(arguments, "#/properties/arguments")
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": CALL_JSON_OPTIONS,
    }


def tool_call_grammar(tools: Sequence[FunctionTool], *, is_parallel: bool) -> str:
    """Lark text: call ("\\n" call)* (or one call), each call one of `tools`."""
    calls = 'call ("\\n" call)*' if is_parallel else "call"
    functions = " | ".join(f"fn_{i}" for i in range(len(tools)))
    lines = [
        f"start: {calls}",
        f'call: <tool_call> "\\n" ({functions}) "\\n" </tool_call>',
    ]
    lines += [f"fn_{i}: %json {json.dumps(call_schema(t))}" for i, t in enumerate(tools)]
    return "\n".join(lines) + "\n"


def tool_call_constraint(
    tools: Sequence[FunctionTool],
    choice: ToolChoice,
    *,
    is_parallel: bool = True,
) -> Constraint | None:
    """The constraint that enforces `choice` over `tools` (checked by tools.check_tools), or
    None when nothing is enforced (auto, none). InvalidArgument naming `tools` when the
    grammar is over the constraint limits, `tools[i].parameters` for numeric bounds the
    grammar library would not enforce (schema.unenforced_bounds)."""
    if not choice.is_forced:
        return None
    chosen = [t for t in tools if choice.mode == "required" or t.name == choice.function_name]
    for i, tool in enumerate(tools):
        parameters = parse_object(tool.parameters) if tool in chosen and tool.parameters else None
        unenforced = unenforced_bounds(parameters) if parameters is not None else None
        if unenforced is not None:
            raise InvalidArgument(f"tools[{i}].parameters", tool.parameters, unenforced)
    text = tool_call_grammar(chosen, is_parallel=is_parallel)
    constraint = Constraint.grammar(text)
    try:
        validate(constraint)
    except InvalidArgument as err:
        reason = "; ".join(v.description for v in err.violations)
        raise InvalidArgument(
            "tools", f"{len(chosen)} tools", f"too large to enforce ({reason})"
        ) from None
    return constraint


def bad_tool(tools: Sequence[FunctionTool], choice: ToolChoice) -> InvalidArgument | None:
    """InvalidArgument naming `tools[i].parameters` for the first enforced tool whose call
    llguidance cannot compile alone (an unsupported keyword, nesting past the limits), else
    None. For the error path of a tool constraint that did not compile: the grammar's own
    error names `sampling.grammar`, which the caller never sent. Compiles each tool: ~1 ms."""
    for i, tool in enumerate(tools):
        if not (choice.mode == "required" or tool.name == choice.function_name):
            continue
        field = f"tools[{i}].parameters"
        if tool.parameters and json_depth(parse_object(tool.parameters)) > MAX_JSON_DEPTH:
            return InvalidArgument(
                field, tool.parameters, f"nested deeper than {MAX_JSON_DEPTH} levels"
            )
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(call_schema(tool))
            error = llguidance.LLMatcher.validate_grammar(grammar)
        except ValueError as e:
            error = str(e)
        if error:
            return InvalidArgument(field, tool.parameters, reword(error))
    return None
