"""JSON Schema before the grammar library sees it: objects closed, references rebased where a
schema is embedded in another (a tool's parameters in its call), refusals worded for users.

Closed objects. JSON Schema lets an object carry properties it does not list unless
`additionalProperties` is false; a grammar that allows them lets a sampler write keys and values
forever, and no schema with `properties` would bound its output. Like OpenAI's strict mode and
xgrammar's `strict_mode`, every subschema that lists `properties` (and says nothing of
`additionalProperties`, `patternProperties` or `unevaluatedProperties`) is closed. What is
generated still validates against the schema as sent: it only leaves out extra keys.

Left open, as closing would forbid keys the schema allows: `allOf` branches (each other's keys),
an object whose `properties` sit beside `allOf`, `anyOf`, `oneOf` or `$ref` (their keys join
its own: it is not closed, nor are those `anyOf`/`oneOf` branches), and one that requires a key
it does not list. What describes the same value as an open subschema stays open with it: its
`anyOf`/`oneOf` branches and the `$defs` entry its `$ref` names (an `allOf` branch
`{"$ref": "#/$defs/base"}` leaves `base` open), at any depth.

Numeric bounds llguidance would not enforce are refused by name (`unenforced_bounds`) rather
than let through outputs the schema forbids: it reads bounds as 64-bit floats (an integer past
2**53 moves), and its number expression lets a whole exclusive bound itself through when the
other bound has the same integer part (exclusiveMinimum 100 with maximum 100.5 allows `100`;
minimum -0.5 with exclusiveMaximum 0 allows `-0`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords whose value is one subschema, or a map / list of subschemas.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_LIST = ("anyOf", "oneOf", "prefixItems")


def close_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` whose listed-property objects allow no other keys."""
    # A `$defs` entry stays open when a `$ref` to it sits in an open subschema, which may
    # itself be an entry left open: walk again until no new one is found.
    open_refs: frozenset[str] = frozenset()
    while True:
        found: set[str] = set()
        closed = _close(schema, True, open_refs, found)
        if found <= open_refs:
            return closed
        open_refs |= found


# Beside `properties`, these bring keys of their own into the same object.
_JOINING = ("allOf", "anyOf", "oneOf", "$ref")


def _close(
    node: Any, closable: bool, open_refs: frozenset[str], found: set[str], path: str = "#"
) -> Any:
    """`node` closed where `closable` (and where its own keys allow); the local `$ref`s whose
    target must stay open (named from an open subschema or beside `properties`: the target
    describes this same value) are added to `found`."""
    if not isinstance(node, dict):
        return node
    has_properties = isinstance(node.get("properties"), dict)
    joined = has_properties and _brings_keys(node)
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and (has_properties or not closable):
        found.add(ref)
    out: dict[str, Any] = {}
    for key, value in node.items():
        where = f"{path}/{key}"
        if key in _ONE:
            out[key] = _close(value, True, open_refs, found, where)
        elif key in _MAP and isinstance(value, dict):
            out[key] = {
                name: _close(
                    sub, f"{where}/{name}" not in open_refs, open_refs, found, f"{where}/{name}"
                )
                for name, sub in value.items()
            }
        elif key in _LIST and isinstance(value, list):
            # Branches beside properties stay open: closed, each would forbid the object's
            # other keys. So do those of an open subschema (they describe its value).
            branches_closable = key == "prefixItems" or (closable and not has_properties)
            out[key] = [
                _close(sub, branches_closable, open_refs, found, f"{where}/{i}")
                for i, sub in enumerate(value)
            ]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [
                _close(sub, False, open_refs, found, f"{where}/{i}") for i, sub in enumerate(value)
            ]
        else:
            out[key] = value
    is_open = any(key in node for key in _OPEN_KEYS)
    required = node.get("required", [])
    lists_required = (
        isinstance(required, list)
        and all(isinstance(name, str) for name in required)  # else the library says what
        and set(required) <= set(node["properties"] if has_properties else ())
    )
    if closable and has_properties and not is_open and not joined and lists_required:
        out["additionalProperties"] = False
    return out


def rebase_refs(node: Any, root: str) -> Any:
    """A copy of `node` whose local references ("#", "#/$defs/X": pydantic's nested models)
    point into it where it now sits, at `root` of a schema that embeds it. A subschema with an
    `$id` of its own (its references resolve against it) and "#name" anchors stay as they are."""
    if isinstance(node, list):
        return [rebase_refs(item, root) for item in node]
    if not isinstance(node, dict) or "$id" in node:
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = root + value[1:]
        elif key in _ONE or key in _LIST or key == "allOf":
            out[key] = rebase_refs(value, root)
        elif key in _MAP and isinstance(value, dict):  # its keys are names, not keywords
            out[key] = {name: rebase_refs(sub, root) for name, sub in value.items()}
        else:  # a value (const, enum, default...) or an annotation: no reference inside
            out[key] = value
    return out


def _brings_keys(node: dict[str, Any]) -> bool:
    """Whether what sits beside the object's `properties` may bring keys they do not list:
    `allOf` or a `$ref` (whatever they hold), an `anyOf`/`oneOf` branch naming another key or
    composing further. "At least one of these" (branches that only require listed keys) brings
    none: that object is still closed."""
    if "allOf" in node or "$ref" in node:
        return True
    listed = set(node["properties"])
    for key in ("anyOf", "oneOf"):
        branches = node.get(key, [])
        if not isinstance(branches, list):
            return True  # malformed: left as sent, for the library to refuse naming it
        for branch in branches:
            if not isinstance(branch, dict) or any(k in branch for k in (*_JOINING, *_OPEN_KEYS)):
                return True
            properties, required = branch.get("properties", {}), branch.get("required", [])
            if not isinstance(properties, dict) or not isinstance(required, list):
                return True
            if not all(isinstance(name, str) for name in required):
                return True
            if (set(properties) | set(required)) - listed:
                return True
    return False


class _Bound(NamedTuple):
    keyword: str
    value: int | float

    @property
    def is_exclusive(self) -> bool:
        return self.keyword.startswith("exclusive")


_LOWER = ("minimum", "exclusiveMinimum")
_UPPER = ("maximum", "exclusiveMaximum")
_MAX_EXACT_INTEGER = 2**53  # past it a 64-bit float does not hold every integer


def unenforced_bounds(schema: dict[str, Any]) -> str | None:
    """Why llguidance would let a number outside some subschema's bounds through (the
    keywords named, for an InvalidArgument), or None. A subschema's bounds include its
    `allOf` branches' (and what their local `$ref`s name), which the library merges."""
    for node in _subschemas(schema):
        bounds = _bounds(node, schema, set())
        for bound in bounds:
            if isinstance(bound.value, int) and abs(bound.value) > _MAX_EXACT_INTEGER:
                return (
                    f"unsupported JSON Schema bound: {bound.keyword} {bound.value} (the grammar "
                    "library reads bounds as 64-bit floats: past 2**53 they would not be enforced)"
                )
        lower = max(
            (b for b in bounds if b.keyword in _LOWER),
            key=lambda b: (b.value, b.is_exclusive),
            default=None,
        )
        upper = min(
            (b for b in bounds if b.keyword in _UPPER),
            key=lambda b: (b.value, not b.is_exclusive),
            default=None,
        )
        if lower is None or upper is None:
            continue
        for whole, other in ((lower, upper), (upper, lower)):
            if (
                whole.is_exclusive
                and float(whole.value).is_integer()
                and other.value != whole.value
                and math.isfinite(other.value)  # json.loads reads Infinity and NaN
                and math.trunc(other.value) == whole.value
            ):
                return (
                    f"unsupported JSON Schema bounds: {lower.keyword} {lower.value} with "
                    f"{upper.keyword} {upper.value} (the grammar library would allow "
                    f"{whole.value} itself: an exclusive whole bound with another of the same "
                    "integer part is not enforced)"
                )
    return None


def _bounds(node: dict[str, Any], root: dict[str, Any], seen: set[str]) -> list[_Bound]:
    """`node`'s numeric bounds and those of its `allOf` branches, through local `$ref`s."""
    found = [
        _Bound(key, value)
        for key in (*_LOWER, *_UPPER)
        if isinstance(value := node.get(key), (int, float)) and not isinstance(value, bool)
    ]
    branches = node.get("allOf")
    for branch in branches if isinstance(branches, list) else ():
        if not isinstance(branch, dict):
            continue
        found += _bounds(branch, root, seen)
        ref = branch.get("$ref")
        if isinstance(ref, str) and ref not in seen:
            seen.add(ref)
            target = _local_target(root, ref)
            if target is not None:
                found += _bounds(target, root, seen)
    return found


def _local_target(root: dict[str, Any], ref: str) -> dict[str, Any] | None:
    """The subschema a local `$ref` ("#/$defs/A") names, or None."""
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, dict) else None


def _subschemas(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every subschema of `schema`, itself first, without recursion."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node
        for key, value in node.items():
            if key in _ONE:
                stack.append(value)
            elif key in _MAP and isinstance(value, dict):
                stack.extend(value.values())
            elif (key in _LIST or key == "allOf") and isinstance(value, list):
                stack.extend(value)


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
