"""Constrained sampling from random logits on the demo tokenizer: every output terminates and
matches its constraint (JSON Schema via `jsonschema`, regex via `re.fullmatch`, choices)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from tokenizers import Tokenizer

from mili.engine.constraint.compiler import ConstraintCompiler
from mili.engine.constraint.spec import Constraint
from mili.engine.constraint.vocab import GrammarTokenizer
from tests.engine.constraint_helpers import demo_grammar_tokenizer, sample

SEEDS = range(4)  # x 16 rows each: 64 outputs per constraint
_STRING = re.compile(r'"(?:\\.|[^"\\])*"')

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 150},
                },
                "required": ["name", "age"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "array_max_items": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4}
        },
        "required": ["tags"],
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, None]}},
        "required": ["color", "size"],
    },
    "numbers": {
        "type": "object",
        "properties": {
            "x": {"type": "number"},
            "n": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["x", "n"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 5},
            "b": {"type": "integer"},
            "c": {"type": "boolean"},
        },
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["id"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "ref_any_of": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {
            "p": {"$ref": "#/$defs/point"},
            "v": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]},
        },
        "required": ["p", "v"],
    },
    # exclusive bounds llguidance enforces (those it does not are refused: test_constraint.py)
    "exclusive_bounds": {
        "type": "object",
        "properties": {
            "a": {"type": "number", "exclusiveMinimum": 100, "maximum": 101},
            "b": {"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 2},
            "c": {"type": "number", "minimum": 99.5, "exclusiveMaximum": 100},
            "d": {"type": "number", "exclusiveMinimum": 100.5, "maximum": 101},
            "e": {"type": "integer", "exclusiveMinimum": 5, "maximum": 6.5},
            "f": {"type": "integer", "minimum": 2**53 - 2, "maximum": 2**53},
        },
        "required": ["a", "b", "c", "d", "e", "f"],
    },
    # an allOf branch that is a $ref: the entry it names stays open, as an inline branch
    # (closed, it forbade "y": refused as unsatisfiable); closed by the object's own keys
    "all_of_ref": {
        "$defs": {
            "base": {
                "type": "object",
                "properties": {"x": {"type": "integer"}},
                "required": ["x"],
            }
        },
        "allOf": [
            {"$ref": "#/$defs/base"},
            {"properties": {"y": {"type": "boolean"}}, "required": ["y"]},
        ],
        "properties": {"x": {}, "y": {}},
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> GrammarTokenizer:
    return demo_grammar_tokenizer(demo_model_dir)


@pytest.fixture(scope="module")
def hf(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def compiler(tokenizer: GrammarTokenizer) -> ConstraintCompiler:
    return ConstraintCompiler(tokenizer)


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_outputs_terminate_and_validate(
    name: str, compiler: ConstraintCompiler, hf: Tokenizer
) -> None:
    schema = SCHEMAS[name]
    compiled = compiler.compile_sync(Constraint.json_schema(schema))
    for seed in SEEDS:
        run = sample(compiled, hf, seed)
        assert all(run.finished), (name, seed, run.steps)
        for text in run.texts:
            jsonschema.validate(json.loads(text), schema)
            outside_strings = _STRING.sub('""', text)
            assert not re.search(r"\s", outside_strings), f"free whitespace in {text!r}"


@pytest.mark.parametrize(
    "pattern",
    [r"[A-Z]{3}-[0-9]{2,4}", r"(yes|no|maybe)", r"[0-9]{1,3}(\.[0-9]{1,3}){3}", r"[a-z ]{1,20}\."],
)
def test_regex_outputs_fullmatch(pattern: str, compiler: ConstraintCompiler, hf: Tokenizer) -> None:
    compiled = compiler.compile_sync(Constraint.regex(pattern))
    for seed in SEEDS:
        run = sample(compiled, hf, seed)
        assert all(run.finished)
        for text in run.texts:
            assert re.fullmatch(pattern, text), (pattern, text)


def test_choice_outputs_are_choices(compiler: ConstraintCompiler, hf: Tokenizer) -> None:
    choices = ["positive", "negative", "neutral", "mixed feelings", "n/a"]
    compiled = compiler.compile_sync(Constraint.choice(choices))
    seen: set[str] = set()
    for seed in SEEDS:
        run = sample(compiled, hf, seed)
        assert all(run.finished)
        assert set(run.texts) <= set(choices), run.texts
        seen |= set(run.texts)
    assert len(seen) > 1  # the draw is random, not stuck on one choice


@pytest.mark.parametrize(
    ("grammar", "pattern"),
    [
        (
            'start: "(" item ")" | "(" item "," item ")"\nitem: /[0-9]{1,3}/ | "x"',
            r"\((\d{1,3}|x)(,(\d{1,3}|x))?\)",
        ),
        (
            'root ::= "[" item ("," item)? "]"\nitem ::= [0-9] | "true"',
            r"\[(\d|true)(,(\d|true))?\]",
        ),
    ],
    ids=["lark", "gbnf"],
)
def test_grammar_outputs_match(
    grammar: str, pattern: str, compiler: ConstraintCompiler, hf: Tokenizer
) -> None:
    compiled = compiler.compile_sync(Constraint.grammar(grammar))
    for seed in SEEDS:
        run = sample(compiled, hf, seed)
        assert all(run.finished)
        for text in run.texts:
            assert re.fullmatch(pattern, text), text


def test_json_object_outputs_parse_as_objects(compiler: ConstraintCompiler, hf: Tokenizer) -> None:
    """Any JSON object: strings have no length bound, so random logits write long ones; the
    bound on steps is loose, but each output still ends and parses."""
    compiled = compiler.compile_sync(Constraint.json_object())
    run = sample(compiled, hf, seed=0, batch=8, max_steps=6000)
    assert all(run.finished), run.steps
    for text in run.texts:
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("constraint", "pattern"),
    [
        (Constraint.regex("<think>abc"), r"<think>abc"),
        (Constraint.regex("x</think>"), r"x</think>"),
        (Constraint.choice(["<tool_call>"]), r"<tool_call>"),
        (
            Constraint.json_schema(
                {
                    "type": "object",
                    "properties": {"<think>": {"enum": ["</tool_call>", "no"]}},
                    "required": ["<think>"],
                }
            ),
            r'\{"<think>":"(</tool_call>|no)"\}',
        ),
    ],
    ids=["regex", "regex_after", "choice", "json_schema"],
)
def test_text_that_spells_a_special_token_is_written_in_pieces(
    constraint: Constraint, pattern: str, compiler: ConstraintCompiler, hf: Tokenizer
) -> None:
    """llguidance offers a special token (<think>: one token of Qwen3's vocabulary) where the
    grammar forces its text, then refuses it (its grammar reads text, and the token is none):
    the mask must offer only what the matcher takes, so the text comes out in plain pieces."""
    compiled = compiler.compile_sync(constraint)
    for seed in SEEDS:
        run = sample(compiled, hf, seed)  # every sampled token accepted: asserted per step
        assert all(run.finished)
        for text in run.texts:
            assert re.fullmatch(pattern, text), text
