"""OpenAI's and vLLM's structured-output parameters -> one Constraint (pure mapping).

    response_format     {"type": "text"}                                  nothing
                        {"type": "json_object"}                           json_object
                        {"type": "json_schema", "json_schema":
                           {"name", "schema", "strict"?, "description"?}}  json_schema
    guided_json         a JSON Schema (object, or its JSON text)           json_schema
    guided_regex        a regular expression                               regex
    guided_choice       an array of strings                                choice
    guided_grammar      a grammar (llguidance's Lark, or GBNF)             grammar
    structured_outputs  {"json" | "regex" | "choice" | "grammar" |         (vLLM's newer spelling
                         "json_object": true}                               of the guided_* ones)

One constraint per request: two of these at once (say response_format and guided_regex), or
two keys of structured_outputs, are refused naming the second; so is a vLLM one with
tool_choice required or a named function, which is enforced by a constraint of its own
(services/frontend/tool_grammar.py). A response_format there is checked but not applied: it
shapes the answer's content, and that answer is calls alone, so there is nothing to shape (as
OpenAI and vLLM take it: agent libraries send an agent's output type with every turn, its
forced tool calls included). `strict` is accepted either way: a schema is always
enforced, and a keyword the grammar engine would not enforce is refused, never ignored.
Sizes are checked here (mili.engine.constraint.spec.validate), so a schema over the limits is a
400 naming its parameter before anything runs; compile errors come from prefill and decode.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from mili.engine.constraint.spec import Constraint, validate
from mili.errors import FieldViolation, InvalidArgument
from services.frontend.http_api.body import Body
from services.frontend.tools import ToolChoice

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_UNSUPPORTED_STRUCTURED = ("structural_tag",)  # vLLM's keys this server does not do


class Requested(NamedTuple):
    constraint: Constraint
    param: str  # the parameter it came from, named in its errors


def constraint_of(body: Body, tool_choice: ToolChoice | None = None) -> Requested | None:
    """The request's constraint, or None; InvalidArgument naming the parameter."""
    found: list[Requested] = []
    response_format = body.object("response_format")
    if response_format is not None:
        constraint = _response_format(response_format)
        if constraint is not None:
            found.append(Requested(constraint, "response_format"))
    for key, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        if body.has(key):
            found.append(Requested(_of_kind(kind, body.raw(key), key), key))
    structured = body.object("structured_outputs")
    if structured is not None:
        for key in _UNSUPPORTED_STRUCTURED:  # refused, never ignored
            if structured.raw(key) is not None:
                raise InvalidArgument(
                    structured.name(key), structured.raw(key), "not supported by this server"
                )
        for key in _STRUCTURED_KEYS:
            value = structured.raw(key)
            if value is not None and value is not False:
                where = structured.name(key)
                found.append(Requested(_of_kind(key, value, where), where))
    if len(found) > 1:
        first, second = found[0].param, found[1].param
        reason = f"one constraint per request: {first} is set too"
        raise InvalidArgument(second, body.raw(second.split(".")[0]), reason)
    if not found:
        return None
    requested = found[0]
    forced = tool_choice if tool_choice is not None and tool_choice.is_forced else None
    if forced is not None and requested.param != "response_format":
        reason = (
            f"tool_choice {forced.mode} is enforced with a constraint of its own; "
            f"drop {requested.param} or use tool_choice auto"
        )
        raise InvalidArgument("tool_choice", forced.mode, reason)
    try:
        validate(requested.constraint)
    except InvalidArgument as err:
        # Named after the parameter: sampling.choice.choices[1] -> guided_choice[1]
        own = requested.constraint.field_name()
        violations = [
            FieldViolation(requested.param + v.field.removeprefix(own), v.description)
            for v in err.violations
        ]
        raise InvalidArgument.many(violations) from None
    return None if forced is not None else requested


def _response_format(response_format: Body) -> Constraint | None:
    kind = response_format.text("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        spec = response_format.object("json_schema")
        if spec is None:
            raise InvalidArgument("response_format.json_schema", None, "required")
        spec.text("name")
        spec.flag("strict")
        schema = spec.object("schema")
        if schema is None:
            raise InvalidArgument("response_format.json_schema.schema", None, "required")
        return Constraint.json_schema(json.dumps(schema.data))
    raise InvalidArgument(
        "response_format.type", kind, 'must be "text", "json_object" or "json_schema"'
    )


def _of_kind(kind: str, value: Any, param: str) -> Constraint:
    if kind == "json":
        if isinstance(value, dict):
            return Constraint.json_schema(json.dumps(value))
        if isinstance(value, str):
            return Constraint.json_schema(value)
        raise InvalidArgument(param, value, "must be a JSON Schema (an object or its JSON text)")
    if kind == "json_object":
        if value is not True:
            raise InvalidArgument(param, value, "must be true")
        return Constraint.json_object()
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidArgument(param, value, "must be an array of strings")
        return Constraint.choice(value)
    if not isinstance(value, str):
        raise InvalidArgument(param, value, "must be a string")
    return Constraint.regex(value) if kind == "regex" else Constraint.grammar(value)
