"""Tools a chat offers the model, and the calls it made: validated, and shaped for a template.

Both carry JSON as text on the wire (a tool's JSON-Schema parameters, a call's arguments) and are
parsed once here, with the field named in the error, into the structures HF's
`apply_chat_template(messages, tools=...)` hands a template:

    tool       {"type": "function", "function": {"name", "description"?, "parameters"?,
                "strict"?}}, the function's keys in the caller's order (function_keys)
    tool call  {"id", "type": "function", "function": {"name", "arguments": {...}}}

Parsed JSON keeps its key order and integer-vs-float distinction (json.loads), so a template's
`tojson` writes it back as the caller wrote it, modulo whitespace: Qwen3's own spacing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mili.errors import InvalidArgument
from mili.text import strict_json
from mili.text.surrogate import lone_surrogate_path

# OpenAI's rule for function names; it also keeps control-token strings out of them.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A function object's keys as OpenAI defines them, in the order written when none is given.
FUNCTION_KEYS = ("name", "description", "parameters", "strict")


def parse_json_object(text: str, field: str) -> dict[str, Any]:
    """`text` as a JSON object (key order kept), or InvalidArgument naming `field`."""
    try:
        value = strict_json.loads(text)
    except ValueError as e:
        raise InvalidArgument(field, text, f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(field, text, f"must be a JSON object, found {type(value).__name__}")
    where = lone_surrogate_path(value)
    if where is not None:
        raise InvalidArgument(
            f"{field}.{where}", text, "holds a lone UTF-16 surrogate escape: not text"
        )
    return value


def map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """`value` (parsed JSON) with `fn` applied to every string in it, keys included."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {fn(k): map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [map_strings(v, fn) for v in value]
    return value


def strings_in(value: Any) -> Iterator[str]:
    """Every string in `value` (parsed JSON), keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from strings_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings_in(v)


@dataclass(frozen=True)
class Tool:
    """A function offered to the model; `parameters` is a parsed JSON Schema object or None,
    `strict` OpenAI's flag or None (unset), `keys` the function object's keys in the caller's
    order (of FUNCTION_KEYS). Rendered: the listed keys in their order (an empty description
    too), then the others that are set (a description unless empty) in FUNCTION_KEYS' order."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    keys: tuple[str, ...] = ()

    @classmethod
    def parse(
        cls,
        name: str,
        description: str,
        parameters: str,
        field: str,
        *,
        strict: bool | None = None,
        keys: tuple[str, ...] = (),
    ) -> Tool:
        """From the wire form (parameters as JSON text, "" for none); `field` is "tools[i]"."""
        if not name:
            raise InvalidArgument(f"{field}.name", name, "required: the function's name")
        if not _NAME.fullmatch(name):
            raise InvalidArgument(
                f"{field}.name", name, "must be 1 to 64 letters, digits, '_' or '-'"
            )
        for j, key in enumerate(keys):
            if key not in FUNCTION_KEYS or key in keys[:j]:
                raise InvalidArgument(
                    f"{field}.function_keys[{j}]",
                    key,
                    f"must be one of {', '.join(FUNCTION_KEYS)}, each at most once",
                )
        schema = parse_json_object(parameters, f"{field}.parameters") if parameters else None
        return cls(name, description, schema, strict, keys)

    def texts(self) -> Iterator[str]:
        yield self.name
        yield self.description
        yield from strings_in(self.parameters)

    def map_text(self, fn: Callable[[str], str]) -> Tool:
        parameters = map_strings(self.parameters, fn)
        return Tool(fn(self.name), fn(self.description), parameters, self.strict, self.keys)

    def as_dict(self) -> dict[str, Any]:
        """The OpenAI tool dict HF's apply_chat_template is handed: the function's keys in the
        caller's order, so a template's `tojson` writes what it would for the caller's dict."""
        values = {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict,
        }
        order = [*self.keys, *(k for k in FUNCTION_KEYS if k not in self.keys)]
        function = {
            k: values[k]
            for k in order
            if values[k] is not None and (values[k] != "" or k in self.keys)  # "" if listed
        }
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made; `arguments` is the parsed JSON object."""

    name: str
    arguments: dict[str, Any]
    id: str = ""

    @classmethod
    def parse(cls, call_id: str, name: str, arguments: str, field: str) -> ToolCall:
        """From the wire form; `field` is "messages[i].tool_calls[j]"."""
        if not name:
            raise InvalidArgument(f"{field}.name", name, "required: the called function's name")
        return cls(name, parse_json_object(arguments, f"{field}.arguments"), call_id)

    def texts(self) -> Iterator[str]:
        yield self.name
        yield from strings_in(self.arguments)

    def map_text(self, fn: Callable[[str], str]) -> ToolCall:
        return ToolCall(fn(self.name), map_strings(self.arguments, fn), self.id)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
