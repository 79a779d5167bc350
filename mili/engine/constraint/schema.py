"""JSON Schema before the grammar library sees it: objects closed, refusals worded for users.

Closed objects. JSON Schema lets an object carry properties it does not list unless
`additionalProperties` is false; a grammar that allows them lets a sampler write keys and values
forever, and no schema with `properties` would bound its output. Like OpenAI's strict mode and
xgrammar's `strict_mode`, every subschema that lists `properties` (and says nothing of
`additionalProperties`, `patternProperties` or `unevaluatedProperties`) is closed. What is
generated still validates against the schema as sent: it only leaves out extra keys.

`allOf` branches are left open: closing each branch would forbid the other branches' keys.
"""

from __future__ import annotations

import re
from typing import Any

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords whose value is one subschema, or a map / list of subschemas.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_LIST = ("anyOf", "oneOf", "prefixItems")


def close_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` whose listed-property objects allow no other keys."""
    return _close(schema, closable=True)


def _close(node: Any, closable: bool) -> Any:
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _ONE:
            out[key] = _close(value, True)
        elif key in _MAP and isinstance(value, dict):
            out[key] = {name: _close(sub, True) for name, sub in value.items()}
        elif key in _LIST and isinstance(value, list):
            out[key] = [_close(sub, True) for sub in value]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_close(sub, False) for sub in value]
        else:
            out[key] = value
    is_open = not any(key in node for key in _OPEN_KEYS)
    if closable and is_open and "properties" in node and "allOf" not in node:
        out["additionalProperties"] = False
    return out


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")


def reword(error: str) -> str:
    """llguidance's compile error for a schema, in words a caller can act on."""
    found = _UNIMPLEMENTED.search(error)
    if found:
        names = ", ".join(name.strip().strip('"') for name in found.group(1).split(","))
        return f"unsupported JSON Schema keywords: {names} (they would not be enforced)"
    if "oneOf constraints are not supported" in error:
        return "unsupported JSON Schema keyword: oneOf (use anyOf)"
    return f"invalid or unsupported JSON Schema: {' '.join(error.split())[:300]}"
