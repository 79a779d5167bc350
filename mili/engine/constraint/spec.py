r"""What a request asks its output to match: a `Constraint`, and the size limits it must meet.

Pure Python (no grammar library, no torch): the frontend and the transport layer build and
validate constraints without loading the engine. The grammar library sees a constraint only
in `compiler.py`.

Kinds:

    json_schema   a JSON Schema (draft 2020-12 keywords llguidance enforces; the compiler refuses
                  the rest by name), output as compact JSON (no free whitespace)
    json_object   any JSON object, compact
    regex         a regular expression the whole output must match (Rust `regex` syntax: no
                  look-around or back-references), as `re.fullmatch`; `\d`, `\w` and `\s`
                  are Unicode classes (write [0-9] for ASCII digits)
    grammar       a context-free grammar in llguidance's Lark dialect (`start: ...`), or in
                  llama.cpp's GBNF (`root ::= ...`, recognised by `::=`), converted by llguidance
    choice        exactly one of a list of strings

Where it starts (`think`): a chat answer of Qwen3's with thinking on begins with its reasoning,
which no constraint of the caller's should touch. The frontend, which knows the thinking switch
and the prompt, says which shape the output has; the compiler puts the think block before the
constraint's grammar (think.py):

    none       the constraint from the first token (prompts, chat with thinking off)
    optional   `<think>` any text `</think>` "\n\n", or nothing, then the constraint (Qwen3's
               hybrid template: the model opens the block itself)
    open       any text `</think>` "\n\n", then the constraint (the template opened the block
               in the prompt: the output starts inside it)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from mili.errors import InvalidArgument, count_of

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
KINDS: tuple[str, ...] = get_args(ConstraintKind)
ThinkBlock = Literal["none", "optional", "open"]
THINK_BLOCKS: tuple[str, ...] = get_args(ThinkBlock)


# Bounds on a constraint's size, checked before any compile (INVALID_ARGUMENT past them).
MAX_TEXT_BYTES = {"json_schema": 64 * 1024, "regex": 4 * 1024, "grammar": 64 * 1024}
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 256
# Nesting of the schema's JSON: our own walk of it (compiler.py) recurses once per level.
MAX_JSON_DEPTH = 64


@dataclass(frozen=True)
class Constraint:
    """One request's output constraint. `text` is the schema, regex or grammar as sent (empty
    for json_object and choice); `choices` holds a choice's strings; `think` the think block
    before it (module docstring). Equal constraints have equal `key`s, which key the compile
    cache: the same schema after a think block and without one are two grammars."""

    kind: ConstraintKind
    text: str = ""
    choices: tuple[str, ...] = ()
    think: ThinkBlock = "none"
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {KINDS}, got {self.kind!r}")
        if self.think not in THINK_BLOCKS:
            raise ValueError(f"constraint think must be one of {THINK_BLOCKS}, got {self.think!r}")
        fields = [self.kind, self.text, list(self.choices), self.think]
        digest = hashlib.sha256(json.dumps(fields).encode())
        object.__setattr__(self, "key", digest.hexdigest())

    @classmethod
    def json_schema(cls, schema: str | dict[str, Any]) -> Constraint:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        return cls("grammar", text)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> Constraint:
        return cls("choice", choices=tuple(choices))

    def after_think(self, think: ThinkBlock) -> Constraint:
        """This constraint with `think` before it."""
        return dataclasses.replace(self, think=think)

    def field_name(self) -> str:
        """The request field this constraint came from, for error messages (`field_of`)."""
        return field_of(self.kind)


def field_of(kind: str) -> str:
    """The request field a constraint of `kind` comes from, for error messages:
    `sampling.regex`; a choice's strings are `sampling.choice.choices`."""
    return "sampling.choice.choices" if kind == "choice" else f"sampling.{kind}"


def json_depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        children = (
            node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        )
        stack.extend((child, level + 1) for child in children)
    return deepest


def parse_schema(constraint: Constraint) -> dict[str, Any]:
    """The json_schema constraint's schema as a dict; InvalidArgument when it is not one."""
    field_name = constraint.field_name()
    try:
        schema = json.loads(constraint.text)
    except (ValueError, RecursionError) as e:
        raise InvalidArgument(field_name, constraint.text, f"not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise InvalidArgument(field_name, constraint.text, "a JSON Schema must be a JSON object")
    if json_depth(schema) > MAX_JSON_DEPTH:
        reason = f"nested deeper than {MAX_JSON_DEPTH} levels"
        raise InvalidArgument(field_name, constraint.text, reason)
    return schema


def validate(constraint: Constraint) -> None:
    """Check `constraint` against the size limits above (and that a schema is a JSON object):
    InvalidArgument naming the field (`field_of`) otherwise. Cheap; the compiler calls it first."""
    field_name = constraint.field_name()
    size = len(constraint.text.encode())
    max_bytes = MAX_TEXT_BYTES.get(constraint.kind)
    if max_bytes is not None:
        if not constraint.text.strip():
            raise InvalidArgument(field_name, constraint.text, "must not be empty")
        if size > max_bytes:
            too_large = count_of(size, "byte")
            raise InvalidArgument(field_name, too_large, f"at most {max_bytes} bytes")
    elif constraint.text:
        raise InvalidArgument(field_name, constraint.text, f"{constraint.kind} takes no text")
    if constraint.kind == "choice":
        choices = constraint.choices
        if not choices or len(choices) > MAX_CHOICES:
            reason = f"between 1 and {MAX_CHOICES} strings"
            raise InvalidArgument(field_name, f"<{len(choices)} strings>", reason)
        for i, choice in enumerate(choices):
            if not choice or len(choice) > MAX_CHOICE_CHARS:
                reason = f"each choice 1 to {MAX_CHOICE_CHARS} characters"
                raise InvalidArgument(f"{field_name}[{i}]", choice, reason)
    elif constraint.choices:
        raise InvalidArgument(field_name, constraint.choices, f"{constraint.kind} takes no choices")
    if constraint.kind == "json_schema":
        parse_schema(constraint)
