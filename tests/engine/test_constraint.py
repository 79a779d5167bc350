"""Constraint spec, compiler and matcher on the demo tokenizer: refusals naming the field, the
compile cache, the time limit, keyword enforcement, closed objects, rollback."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest
import torch

from mili.engine.constraint import compiler as compiler_module
from mili.engine.constraint import mask as matcher_module
from mili.engine.constraint import schema as schemas
from mili.engine.constraint import trial as trial_module
from mili.engine.constraint.compiler import CompileConfig, CompileStats, ConstraintCompiler
from mili.engine.constraint.mask import BatchMasker, FilledMask, unpack_bitmask
from mili.engine.constraint.matcher import ConstraintError, ConstraintMatcher
from mili.engine.constraint.spec import MAX_JSON_DEPTH, Constraint, validate
from mili.engine.constraint.vocab import GrammarTokenizer
from mili.errors import InvalidArgument, ResourceExhausted, Unavailable
from tests.engine.constraint_helpers import demo_grammar_tokenizer


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> GrammarTokenizer:
    return demo_grammar_tokenizer(demo_model_dir)


@pytest.fixture
def compiler(tokenizer: GrammarTokenizer) -> ConstraintCompiler:
    return ConstraintCompiler(tokenizer)


def feed(matcher: ConstraintMatcher, text: str) -> bool:
    """Whether `text` is accepted as a complete output (then EOS)."""
    tokens = matcher.tokenizer.encode(text)
    return all(matcher.accept(t) for t in tokens) and matcher.accept(
        matcher.tokenizer.eos_token_ids[0]
    )


def test_constraint_key_is_content_hash() -> None:
    assert Constraint.json_schema({"a": 1}).key == Constraint("json_schema", '{"a": 1}').key
    assert Constraint.regex("a").key != Constraint.grammar("a").key
    assert Constraint.choice(["a", "b"]).key != Constraint.choice(["b", "a"]).key
    with pytest.raises(ValueError, match="kind"):
        Constraint("yaml", "x")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("constraint", "field", "words"),
    [
        (Constraint.json_schema("{not json"), "sampling.json_schema", "not valid JSON"),
        (Constraint.json_schema("[1, 2]"), "sampling.json_schema", "JSON object"),
        (Constraint.json_schema("x" * (64 * 1024 + 1)), "sampling.json_schema", "at most 65536"),
        (Constraint.json_schema("[" * 100 + "]" * 100), "sampling.json_schema", "JSON"),
        (Constraint.json_schema({"a": json.loads("[" * 20 + "]" * 20)}), None, None),
        (Constraint.regex(""), "sampling.regex", "empty"),
        (Constraint.regex("a" * 5000), "sampling.regex", "at most 4096"),
        (Constraint.choice([]), "sampling.choice.choices", "between 1 and 256"),
        (Constraint.choice(["x"] * 257), "sampling.choice.choices", "between 1 and 256"),
        (Constraint.choice(["ok", "y" * 257]), "sampling.choice.choices[1]", "1 to 256 characters"),
        (Constraint("json_object", "x"), "sampling.json_object", "takes no text"),
    ],
)
def test_spec_limits_name_the_field(
    constraint: Constraint, field: str | None, words: str | None
) -> None:
    if field is None:
        validate(constraint)  # deep enough to be suspicious, within the limit
        return
    with pytest.raises(InvalidArgument) as err:
        validate(constraint)
    assert err.value.violations[0].field == field
    assert words is not None and words in err.value.violations[0].description


def test_json_depth_limit() -> None:
    nested: list[object] = []
    for _ in range(MAX_JSON_DEPTH - 4):
        nested = [nested]
    at_limit = {"type": "object", "properties": {"a": {"x": nested}}}  # MAX_JSON_DEPTH deep
    validate(Constraint.json_schema(at_limit))
    deeper = {"type": "object", "properties": {"a": {"x": [nested]}}}
    with pytest.raises(InvalidArgument, match=f"nested deeper than {MAX_JSON_DEPTH}"):
        validate(Constraint.json_schema(deeper))


@pytest.mark.parametrize(
    ("constraint", "field", "words"),
    [
        (Constraint.json_schema({"type": "strin"}), "sampling.json_schema", "strin"),
        (Constraint.json_schema({"if": {}, "then": {}}), "sampling.json_schema", "if, then"),
        (
            Constraint.json_schema({"type": "array", "uniqueItems": True}),
            "sampling.json_schema",
            "uniqueItems",
        ),
        (Constraint.json_schema({"not": {"type": "null"}}), "sampling.json_schema", "not"),
        (
            Constraint.json_schema({"oneOf": [{"type": "integer"}, {"type": "number"}]}),
            "sampling.json_schema",
            "oneOf",
        ),
        (
            Constraint.json_schema({"type": "string", "format": "no-such"}),
            "sampling.json_schema",
            "no-such",
        ),
        (Constraint.json_schema({"$ref": "#/$defs/missing"}), "sampling.json_schema", "missing"),
        (
            Constraint.json_schema({"$ref": "https://example.com/s.json"}),
            "sampling.json_schema",
            "example.com",
        ),
        (Constraint.regex("(a"), "sampling.regex", "unclosed group"),
        (Constraint.regex("(?=a)b"), "sampling.regex", "look-around"),
        (Constraint.grammar('start: "a" | b'), "sampling.grammar", "unknown name"),
        (Constraint.grammar("root ::= x"), "sampling.grammar", "'x' not found"),
        (Constraint.grammar("start: ("), "sampling.grammar", "does not compile"),
    ],
)
def test_bad_constraints_are_invalid_argument(
    constraint: Constraint, field: str, words: str, compiler: ConstraintCompiler
) -> None:
    with pytest.raises(InvalidArgument) as err:
        compiler.compile_sync(constraint)
    assert err.value.violations[0].field == field
    assert words in err.value.violations[0].description, err.value.violations[0].description


@pytest.mark.parametrize(
    ("schema", "words", "outside"),
    [
        (
            {"type": "number", "exclusiveMinimum": 100, "maximum": 100.5},
            "exclusiveMinimum 100",
            "100",
        ),
        (
            {"type": "number", "exclusiveMinimum": 5, "exclusiveMaximum": 5.5},
            "exclusiveMinimum 5",
            "5",
        ),
        ({"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}, "allow 0 itself", "0"),
        ({"type": "number", "minimum": -0.5, "exclusiveMaximum": 0}, "exclusiveMaximum 0", "-0"),
        ({"type": "number", "minimum": -1.5, "exclusiveMaximum": -1}, "exclusiveMaximum -1", "-1"),
        (  # the library merges allOf branches' bounds
            {"type": "number", "allOf": [{"exclusiveMinimum": 10}, {"maximum": 10.5}]},
            "exclusiveMinimum 10 with maximum 10.5",
            "10",
        ),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "number", "exclusiveMinimum": 10, "maximum": 10.5}},
            },
            "exclusiveMinimum 10",
            '{"a":10}',
        ),
        (
            {"type": "integer", "minimum": 9007199254740993, "maximum": 9007199254740995},
            "minimum 9007199254740993",
            "9007199254740992",
        ),
        ({"type": "integer", "maximum": -(2**53) - 1}, "maximum -9007199254740993", None),
    ],
)
def test_bounds_the_library_would_not_enforce_are_refused_by_name(
    schema: dict[str, Any],
    words: str,
    outside: str | None,
    compiler: ConstraintCompiler,
    tokenizer: GrammarTokenizer,
) -> None:
    """llguidance let through outputs outside these bounds (`outside`; it still does, or the
    refusal can go): refused naming the keywords, as an unsupported keyword is, instead of
    enforcing less than was asked."""
    if outside is not None:
        jsonschema.validate(json.loads(outside), {"not": schema})
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides=compiler_module.JSON_OPTIONS
        )
        assert feed(
            ConstraintMatcher(llguidance.LLMatcher(tokenizer.ll, grammar), tokenizer), outside
        )
    with pytest.raises(InvalidArgument) as err:
        compiler.compile_sync(Constraint.json_schema(schema))
    (violation,) = err.value.violations
    assert violation.field == "sampling.json_schema"
    assert "unsupported JSON Schema bound" in violation.description
    assert words in violation.description, violation.description


# keyword: (schema, a valid instance, an instance only that keyword forbids)
ENFORCED: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "pattern": ({"type": "string", "pattern": "^[a-c]+$"}, "abc", "xyz"),
    "format": ({"type": "string", "format": "date-time"}, "2024-01-02T03:04:05Z", "soon"),
    "minimum": ({"type": "integer", "minimum": 5}, 7, 3),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 1}, 0, 1),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, 6, 4),
    "minLength": ({"type": "string", "minLength": 2}, "ab", "a"),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, [1], [1, 2, 3]),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [1, 2], [1]),
    "prefixItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
        [1],
        ["a"],
    ),
    "const": ({"const": {"a": 1}}, {"a": 1}, {"a": 2}),
    "enum": ({"enum": ["x", 2]}, 2, "y"),
    "$ref": ({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a"}, 1, "s"),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, 3, 1),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, 1, True),
    "required": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"a": 1},
        {},
    ),
    "patternProperties": (
        {
            "type": "object",
            "patternProperties": {"^x": {"type": "integer"}},
            "additionalProperties": False,
        },
        {"x": 1},
        {"x": "s"},
    ),
    "maxProperties": ({"type": "object", "maxProperties": 1}, {"a": 1}, {"a": 1, "b": 2}),
    "minProperties": ({"type": "object", "minProperties": 1}, {"a": 1}, {}),
}


@pytest.mark.parametrize("keyword", ENFORCED)
def test_accepted_keywords_are_enforced(keyword: str, compiler: ConstraintCompiler) -> None:
    """A keyword the compiler accepts must be enforced: an upgrade of the library that starts
    ignoring one fails here (refusing it instead is fine, and the test then says so)."""
    schema, good, bad = ENFORCED[keyword]
    compiled = compiler.compile_sync(Constraint.json_schema(schema))
    compact = {"separators": (",", ":")}
    assert feed(compiled.matcher(), json.dumps(good, **compact))  # type: ignore[arg-type]
    assert not feed(compiled.matcher(), json.dumps(bad, **compact))  # type: ignore[arg-type]


def test_objects_are_closed(compiler: ConstraintCompiler) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    compiled = compiler.compile_sync(Constraint.json_schema(schema))
    assert feed(compiled.matcher(), '{"a":1}')
    assert not feed(compiled.matcher(), '{"a":1,"b":2}')
    assert not feed(compiled.matcher(), '{"a": 1}')  # compact: no free whitespace


def test_close_objects_leaves_all_of_branches_open() -> None:
    schema = {
        "allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}],
        "properties": {"c": {"type": "object", "properties": {"d": {}}}},
        "$defs": {"e": {"properties": {"f": {}}, "additionalProperties": True}},
    }
    closed = schemas.close_objects(schema)
    assert all("additionalProperties" not in branch for branch in closed["allOf"])
    assert "additionalProperties" not in closed  # has allOf
    assert closed["properties"]["c"]["additionalProperties"] is False
    assert closed["$defs"]["e"]["additionalProperties"] is True
    assert schema["properties"]["c"] == {"type": "object", "properties": {"d": {}}}  # a copy


def test_close_objects_leaves_what_an_all_of_branch_names_open() -> None:
    """What a `$ref` in an allOf branch names is that branch's value: closed, it forbade the
    other branches' keys. Entries named only from elsewhere are still closed."""
    closed_def = {"properties": {"q": {}}}
    schema = {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"properties": {"x": {}}}, "c": closed_def},
        "allOf": [{"allOf": [{"$ref": "#/$defs/a"}]}, {"properties": {"y": {}}}],
        "properties": {"p": {"$ref": "#/$defs/c"}},
    }
    closed = schemas.close_objects(schema)
    assert "additionalProperties" not in closed["$defs"]["b"]
    assert closed["$defs"]["c"]["additionalProperties"] is False


@pytest.mark.parametrize(
    ("schema", "good"),
    [
        (  # a $ref beside properties: the base's keys join the object's
            {
                "$defs": {
                    "base": {
                        "type": "object",
                        "properties": {"id": {"type": "integer"}},
                        "required": ["id"],
                    }
                },
                "$ref": "#/$defs/base",
                "properties": {"x": {"type": "boolean"}},
                "required": ["x"],
            },
            {"id": 1, "x": True},
        ),
        (  # anyOf beside properties: a branch's keys join the object's
            {
                "type": "object",
                "properties": {"kind": {"enum": ["a", "b"]}},
                "required": ["kind"],
                "anyOf": [
                    {"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                    {"properties": {"y": {"type": "integer"}}, "required": ["y"]},
                ],
            },
            {"kind": "a", "x": 3},
        ),
        (  # an allOf branch that is a $ref: the entry it names stays open
            {
                "$defs": {
                    "b": {
                        "type": "object",
                        "properties": {"x": {"type": "integer"}},
                        "required": ["x"],
                    }
                },
                "allOf": [
                    {"$ref": "#/$defs/b"},
                    {"properties": {"y": {"type": "boolean"}}, "required": ["y"]},
                ],
            },
            {"x": 1, "y": True},
        ),
        (  # deeper: a nested allOf's $ref to an entry that is a $ref, an anyOf of refs
            {
                "$defs": {
                    "a": {"$ref": "#/$defs/b"},
                    "b": {"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                    "c": {"properties": {"z": {"type": "integer"}}, "required": ["z"]},
                },
                "allOf": [
                    {"allOf": [{"$ref": "#/$defs/a"}]},
                    {"anyOf": [{"$ref": "#/$defs/c"}, {"type": "object"}]},
                    {"properties": {"y": {"type": "boolean"}}, "required": ["y"]},
                ],
            },
            {"x": 1, "y": True, "z": 2},
        ),
        (  # a required key it does not list
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
            {"a": 1, "b": 2},
        ),
    ],
)
def test_objects_whose_keys_come_from_elsewhere_stay_open(
    compiler: ConstraintCompiler, schema: dict[str, Any], good: dict[str, Any]
) -> None:
    """Closing them made valid schemas unsatisfiable: refused with a 400 naming a required key
    (found by a read-only review)."""
    jsonschema.validate(good, schema)
    compiled = compiler.compile_sync(Constraint.json_schema(schema))
    assert feed(compiled.matcher(), json.dumps(good, separators=(",", ":")))


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {}}, "required": [["a"]]},
        {"type": "object", "properties": {"a": {}}, "required": [{"a": 1}]},
        {"type": "object", "properties": None, "required": ["a"]},
        {"type": "object", "properties": 5},
        {"type": "object", "properties": {"a": {}}, "anyOf": 5},
    ],
)
def test_a_malformed_schema_is_invalid_argument_not_a_crash(
    compiler: ConstraintCompiler, schema: dict[str, Any]
) -> None:
    """Closing objects met these as a TypeError (a 500) before the library could refuse them."""
    with pytest.raises(InvalidArgument) as caught:
        compiler.compile_sync(Constraint.json_schema(schema))
    assert caught.value.violations[0].field == "sampling.json_schema"


def test_at_least_one_of_listed_keys_is_still_closed(compiler: ConstraintCompiler) -> None:
    """anyOf branches that only require keys the object lists bring none: the object stays
    closed (left open, a sampler could write extra keys until max_tokens)."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
    }
    compiled = compiler.compile_sync(Constraint.json_schema(schema))
    assert feed(compiled.matcher(), '{"a":1}')
    assert not feed(compiled.matcher(), '{"a":1,"zzz":2}')


def test_a_property_named_limit_is_not_a_limit_hit(compiler: ConstraintCompiler) -> None:
    """llguidance's error quotes the schema; a word of the caller's there once made an
    unsatisfiable schema RESOURCE_EXHAUSTED "too complex" (not cached: compiled again each
    time) instead of INVALID_ARGUMENT."""
    for name in ("limit", "max_items"):
        schema = {
            "type": "object",
            "properties": {name: {"type": "integer", "minimum": 5, "maximum": 1}},
            "required": [name],
        }
        with pytest.raises(InvalidArgument, match="unsatisfiable"):
            compiler.compile_sync(Constraint.json_schema(schema))


def test_a_refused_token_is_too_complex_only_where_a_limit_was_hit(
    compiler: ConstraintCompiler, tokenizer: GrammarTokenizer
) -> None:
    """A regex that compiles but runs the lexer past llguidance's limits five tokens in: the
    refusal is RESOURCE_EXHAUSTED naming the field (the client's grammar), on one line without
    llguidance's `<non-verbose/>`, where a token the grammar simply forbids is a
    ConstraintError (the mask allowed it: a bug)."""
    (a,) = tokenizer.ll.tokenize_str("a")
    heavy = compiler.compile_sync(Constraint.regex("[0-9]{5}((a{90}){90}){90}")).matcher()
    assert all(heavy.accept(t) for t in tokenizer.encode("12345"))
    BatchMasker(tokenizer, 1, num_threads=1).fill([heavy])  # the step's mask: the limit hit
    assert not heavy.accept(a)
    limit_hit = heavy.refusal(a, "output position 5")
    assert isinstance(limit_hit, ResourceExhausted)
    assert str(limit_hit).startswith("sampling.regex: the constraint is too complex (")
    assert "<non-verbose/>" in heavy.error
    assert "<non-verbose/>" not in str(limit_hit) and "\n" not in str(limit_hit)
    digits = compiler.compile_sync(Constraint.regex("[0-9]+")).matcher()
    assert not digits.accept(a)
    refused = digits.refusal(a, "first token")
    assert isinstance(refused, ConstraintError)
    assert f"token {a} (first token) breaks the constraint sampling.regex" in str(refused)


@pytest.mark.parametrize("text", ['start: "a" start', 'start: x "b"\nx: "a" x'])
def test_a_grammar_that_never_ends_is_refused_at_compile(
    text: str, compiler: ConstraintCompiler
) -> None:
    """Its first mask looks fine; llguidance runs out of parser items only when a token is
    taken. The frontend's compile let it through, and prefill refused it at its first token:
    RESOURCE_EXHAUSTED "too complex (parser error: Too many items ... <non-verbose/>)"."""
    with pytest.raises(InvalidArgument) as err:
        compiler.compile_sync(Constraint.grammar(text))
    (violation,) = err.value.violations
    assert violation.field == "sampling.grammar"
    assert "at its start never ends" in violation.description
    assert "matches no finite string" in violation.description


def test_a_grammar_endless_past_a_choice_is_invalid_argument_where_it_gets_there(
    compiler: ConstraintCompiler, tokenizer: GrammarTokenizer
) -> None:
    """Endless only after a choice (compile sees the start's forced text end): the token into
    the endless branch is refused as the start's endless grammar is at compile,
    INVALID_ARGUMENT naming the field and saying why, not RESOURCE_EXHAUSTED "too complex
    (parser error: Too many items (limit 50000; ff_tokens) ...)", which read as a grammar too
    large to a caller whose grammar is three rules."""
    grammar = compiler.compile_sync(Constraint.grammar('start: "b" | "c" x\nx: "a" x'))
    matcher = grammar.matcher()
    (c,), (a,) = tokenizer.ll.tokenize_str("c"), tokenizer.ll.tokenize_str("a")
    assert matcher.accept(c)
    BatchMasker(tokenizer, 1, num_threads=1).fill([matcher])  # the step's mask
    assert not matcher.accept(a)  # the first token of the endless forced text
    refused = matcher.refusal(a, "output position 1")
    assert isinstance(refused, InvalidArgument)
    (violation,) = refused.violations
    assert violation.field == "sampling.grammar"
    assert violation.description.startswith("the text it forces after 1 token never ends")
    assert "matches no finite string" in violation.description


def test_a_grammar_that_names_an_end_of_sequence_token_is_invalid_argument(
    compiler: ConstraintCompiler, tokenizer: GrammarTokenizer
) -> None:
    """llguidance offers an EOS token a grammar names but its matcher refuses it (EOS is the
    model's, where the grammar can end): the mask, mended, was empty, the draw garbage and the
    request INTERNAL. A grammar that starts so is refused at compile; one that gets there is
    INVALID_ARGUMENT naming the field at its refusal. A special token that is no EOS works."""
    eos = tokenizer.eos_token_ids[0]
    name = tokenizer.decode([eos])
    assert name.startswith("<|")
    for text in (f"start: <[{eos}]>", f'start: {name} "a"'):
        with pytest.raises(InvalidArgument) as info:
            compiler.compile_sync(Constraint.grammar(text))
        (violation,) = info.value.violations
        assert violation.field == "sampling.grammar"
        assert "no token can continue it at its start" in violation.description
        assert f"it asks for {name}, an end-of-sequence token" in violation.description

    late = compiler.compile_sync(Constraint.grammar(f'start: "yes" {name}')).matcher()
    assert late.dead_end() is None
    assert all(late.accept(t) for t in tokenizer.encode("yes"))
    mask = BatchMasker(tokenizer, 1, num_threads=1).fill([late])
    assert mask is not None and not unpack_bitmask(mask.bitmask, tokenizer.vocab_rows).any()
    (x,) = tokenizer.ll.tokenize_str("x")
    assert not late.accept(x)  # what a draw from the empty row gives
    refused = late.refusal(x, "output position 1")
    assert isinstance(refused, InvalidArgument)
    assert str(refused).startswith(
        f"sampling.grammar: no token can continue it after {late.num_accepted} tokens: "
        f"it asks for {name}"
    )

    special = next(t for t in tokenizer.special_ids if t not in tokenizer.eos_token_ids)
    named = compiler.compile_sync(Constraint.grammar(f'start: <[{special}]> "a"')).matcher()
    assert named.dead_end() is None and named.accept(special)


def test_cache_hits_on_second_compile(tokenizer: GrammarTokenizer) -> None:
    compiler = ConstraintCompiler(tokenizer)
    schema = {"type": "object", "properties": {"x": {"type": "boolean"}}}
    first = compiler.compile_sync(Constraint.json_schema(schema))
    assert compiler.stats().misses == 1 and compiler.stats().hits == 0
    second = compiler.compile_sync(Constraint.json_schema(json.dumps(schema)))
    assert second is first
    assert compiler.stats().misses == 1 and compiler.stats().hits == 1
    compiler.compile_sync(Constraint.regex("x+"))
    assert compiler.stats().misses == 2


def test_the_cache_is_bounded_by_the_memory_its_compiles_took(
    tokenizer: GrammarTokenizer,
) -> None:
    """Found by reviews: 512 entries of 64 KB schemas were ~2 GB a process, and a 12-byte regex
    compiles to megabytes. The cache keeps the memory its constraints' compiles took (measured
    in the trial's child) under cache_bytes, least recently used out first, the newest always
    in."""
    compiler = ConstraintCompiler(tokenizer, CompileConfig(cache_bytes=4 << 20))
    small = [Constraint.regex(r) for r in ("ab?", "cd?", "x[a-z]{1,5}")]
    for constraint in small:
        assert compiler.compile_sync(constraint).num_bytes < 1 << 20
    for constraint in small:
        compiler.compile_sync(constraint)
    assert (compiler.stats().misses, compiler.stats().hits) == (3, 3)
    big = compiler.compile_sync(Constraint.regex("b{1000}{20}"))  # 20,000 states
    assert big.num_bytes > 4 << 20  # alone over the budget: the others go, it stays
    compiler.compile_sync(Constraint.regex("b{1000}{20}"))
    compiler.compile_sync(small[0])
    assert (compiler.stats().misses, compiler.stats().hits) == (5, 4)


def test_the_memory_budget_counts_each_lane(tokenizer: GrammarTokenizer) -> None:
    """Each lane holds a whole compiled grammar: a small and a ~7 MB constraint fit 10 MiB in
    one lane, not in two."""
    for lanes, misses in ((1, 2), (2, 3)):
        compiler = ConstraintCompiler(tokenizer, CompileConfig(cache_bytes=10 << 20, lanes=lanes))
        compiler.compile_sync(Constraint.regex("ab?"))
        big = compiler.compile_sync(Constraint.regex("b{1000}{20}"))
        assert 4 << 20 < big.num_bytes / lanes < 10 << 20
        compiler.compile_sync(Constraint.regex("ab?"))  # evicted by the big one in two lanes
        assert compiler.stats().misses == misses


def test_a_compile_that_never_ends_is_killed_and_frees_its_slot(
    tokenizer: GrammarTokenizer,
) -> None:
    """llguidance never finishes this grammar's first mask (no fuel limit stops it; its
    memory grows meanwhile). Compiled on a thread of the service, it held a compile slot for
    good: four such requests refused every new constraint until a restart. Tried in a child
    process, it is killed at the time limit."""
    compiler = ConstraintCompiler(tokenizer, CompileConfig(timeout_s=1.0, max_compile_threads=1))
    never = Constraint.grammar("start: A B\nA: /a+/\nB: /a/\n")
    for _ in range(2):  # the second is tried again (and killed again), not refused for slots
        with pytest.raises(ResourceExhausted, match=r"sampling\.grammar: compiling .* over 1\.0 s"):
            compiler.compile_sync(never)
        deadline = time.monotonic() + 5  # the child is killed a moment after the caller's wait
        while compiler.stats().running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert compiler.stats().running == 0
    assert (
        compiler.compile_sync(Constraint.regex("ab?")).matcher().allowed(tokenizer.encode("a")[0])
    )


def test_a_compile_past_the_memory_limit_is_refused_naming_the_field(
    tokenizer: GrammarTokenizer,
) -> None:
    """`b{1000}{900}`, 12 bytes under every size limit, took ~200 MB a compile in each
    service, kept in the cache: a handful of requests grew the frontend past a gigabyte."""
    compiler = ConstraintCompiler(tokenizer)
    for regex in ("b{1000}{900}", "b{1000}{200}"):
        with pytest.raises(ResourceExhausted, match=r"sampling\.regex: .* over 64 MiB of memory"):
            compiler.compile_sync(Constraint.regex(regex))
    assert compiler.stats().running == 0


def test_async_compile_dedupes_concurrent_requests(tokenizer: GrammarTokenizer) -> None:
    compiler = ConstraintCompiler(tokenizer)
    constraint = Constraint.choice(["alpha", "beta"])

    async def both() -> list[Any]:
        return list(
            await asyncio.gather(compiler.compile(constraint), compiler.compile(constraint))
        )

    first, second = asyncio.run(both())
    assert first is second
    assert compiler.stats().misses == 1 and compiler.stats().hits == 1


def test_a_refused_constraint_is_refused_again_without_a_compile(
    compiler: ConstraintCompiler,
) -> None:
    """A client repeating a bad schema costs a lookup, not a compile thread each time: the
    refusal is remembered (bounded like the cache), with the same field and reason."""
    bad = Constraint.json_schema({"not": {"type": "null"}})
    with pytest.raises(InvalidArgument) as first:
        compiler.compile_sync(bad)
    for _ in range(3):
        with pytest.raises(InvalidArgument) as again:
            asyncio.run(compiler.compile(Constraint.json_schema({"not": {"type": "null"}})))
        assert again.value.violations == first.value.violations
    assert compiler.stats().misses == 1 and compiler.stats().hits == 3


def test_cache_is_lru_bounded(tokenizer: GrammarTokenizer) -> None:
    compiler = ConstraintCompiler(tokenizer, CompileConfig(cache_entries=2))
    for pattern in ("a", "b", "c"):
        compiler.compile_sync(Constraint.regex(pattern))
    compiler.compile_sync(Constraint.regex("c"))
    assert compiler.stats().hits == 1
    compiler.compile_sync(Constraint.regex("a"))  # evicted
    assert compiler.stats().misses == 4


@pytest.fixture
def slow_build(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Compiles block until the returned event is set (a stand-in for a hostile grammar)."""
    release = threading.Event()
    real = compiler_module.build

    def build(*args: Any) -> Any:
        release.wait(10)
        return real(*args)

    monkeypatch.setattr(compiler_module, "build", build)
    return release


def test_time_limit_is_resource_exhausted_and_bounds_threads(
    tokenizer: GrammarTokenizer, slow_build: threading.Event
) -> None:
    compiler = ConstraintCompiler(tokenizer, CompileConfig(timeout_s=0.05, max_compile_threads=1))
    slow = Constraint.json_schema({"type": "object", "properties": {"a": {}}})
    with pytest.raises(ResourceExhausted, match=r"sampling\.json_schema: compiling .* took over"):
        compiler.compile_sync(slow)
    assert compiler.stats() == CompileStats(hits=0, misses=1, running=1)
    # The late compile still holds its thread: another is refused, not queued behind it.
    with pytest.raises(ResourceExhausted, match="retry") as err:
        compiler.compile_sync(Constraint.regex("x"))
    assert err.value.retry_after_s == 0.05
    slow_build.set()
    deadline = time.monotonic() + 10
    while compiler.stats().running and time.monotonic() < deadline:
        time.sleep(0.01)
    compiler.compile_sync(slow)  # the late result landed in the cache
    assert compiler.stats() == CompileStats(hits=1, misses=1, running=0)


def test_async_time_limit(tokenizer: GrammarTokenizer, slow_build: threading.Event) -> None:
    compiler = ConstraintCompiler(tokenizer, CompileConfig(timeout_s=0.05))

    async def compile_and_tick() -> None:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        ticker = asyncio.create_task(tick())
        try:
            with pytest.raises(ResourceExhausted, match=r"sampling\.regex"):
                await compiler.compile(Constraint.regex("[a-z]{2,9}@[a-z]{2,9}"))
        finally:
            ticker.cancel()
        assert ticks >= 3  # the loop ran while the compile was stuck

    asyncio.run(compile_and_tick())
    slow_build.set()


def test_matcher_accept_rollback_and_eos(compiler: ConstraintCompiler) -> None:
    compiled = compiler.compile_sync(Constraint.regex("ab?"))
    matcher = compiled.matcher()
    tok = compiled.tokenizer
    eos = tok.eos_token_ids[0]
    assert not matcher.can_finish and not matcher.allowed(eos)
    assert not matcher.allowed(tok.vocab_rows - 1)  # a padded row
    assert not matcher.allowed(tok.vocab_rows + 5)
    (a,) = tok.encode("a")
    assert matcher.accept(a) and matcher.can_finish and not matcher.is_finished
    assert matcher.allowed(eos)
    matcher.rollback(1)
    assert not matcher.can_finish and matcher.num_accepted == 0
    assert not matcher.accept(tok.encode("z")[0])  # forbidden: refused, not consumed
    assert matcher.accept(a) and matcher.accept(eos) and matcher.is_finished
    with pytest.raises(ValueError, match="roll back 3"):
        matcher.rollback(3)


def test_tokenizer_rows_and_fingerprint(demo_model_dir: Path, tokenizer: GrammarTokenizer) -> None:
    data = (demo_model_dir / "tokenizer.json").read_bytes()
    assert tokenizer.num_tokens < tokenizer.vocab_rows
    other = GrammarTokenizer(data, tokenizer.vocab_rows + 64, tokenizer.eos_token_ids)
    assert other.fingerprint != tokenizer.fingerprint
    assert other.file_sha256 == tokenizer.file_sha256
    with pytest.raises(ValueError, match="vocab_rows"):
        GrammarTokenizer(data, tokenizer.num_tokens - 1, tokenizer.eos_token_ids)
    with pytest.raises(ValueError, match="eos_token_ids"):
        GrammarTokenizer(data, tokenizer.vocab_rows, [tokenizer.vocab_rows - 1])


@pytest.mark.parametrize("row_ids", [[0, 1, 2], [1, 3], [2]])
@pytest.mark.parametrize("vocab", [896, 870, 33])
def test_apply_token_bitmask_numpy_and_torch_paths_agree(row_ids: list[int], vocab: int) -> None:
    """The CPU fast path (numpy) and the device path (torch) mask the same entries; unlisted
    rows untouched, columns past the logits' width ignored."""
    gen = torch.Generator().manual_seed(vocab + len(row_ids))
    words = (896 + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(row_ids), words), generator=gen)
    mask = FilledMask(bitmask.to(torch.int32), row_ids)
    logits = torch.randn(4, 896, generator=gen)[:, :vocab]  # a view, as the sampler passes
    by_numpy, by_torch = logits.clone(), logits.clone()
    matcher_module._apply_numpy(by_numpy, mask)
    matcher_module._apply_torch(by_torch, mask)
    assert torch.equal(by_numpy, by_torch)
    allowed = unpack_bitmask(mask.bitmask, vocab)
    for i, row in enumerate(row_ids):
        assert torch.equal(by_numpy[row].isinf(), ~allowed[i])
    untouched = [r for r in range(4) if r not in row_ids]
    assert torch.equal(by_numpy[untouched], logits[untouched])


def _lanes_built(compiled: Any, lanes: int) -> None:
    """Wait (bounded) for the compile thread to add the other lanes after the first."""
    deadline = time.monotonic() + 10
    while len(compiled.lanes) < lanes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(compiled.lanes) == lanes


def test_lanes_are_separate_compiles_dealt_out_in_turn(tokenizer: GrammarTokenizer) -> None:
    """Deep copies of one compiled grammar fill their masks one at a time (they share its
    lexer), so decode keeps a compile per mask thread and deals requests over them."""
    compiler = ConstraintCompiler(tokenizer, CompileConfig(lanes=3))
    schema = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}
    compiled = compiler.compile_sync(Constraint.json_schema(schema))
    _lanes_built(compiled, 3)
    assert len({id(template) for template in compiled.lanes}) == 3
    matchers = [compiled.matcher() for _ in range(4)]
    assert [m.lane for m in matchers] == [0, 1, 2, 0]
    assert all(feed(m, '{"x":true}') for m in matchers)
    assert compiler.stats() == CompileStats(hits=0, misses=1, running=0)


def test_a_batch_of_mixed_lanes_fills_each_row_its_own_mask(tokenizer: GrammarTokenizer) -> None:
    """The masker orders the rows by lane for llguidance's threads: each mask still lands in
    its own row, as the row's matcher alone fills it."""
    compiler = ConstraintCompiler(tokenizer, CompileConfig(lanes=2))
    digits = compiler.compile_sync(Constraint.regex("[0-9]{1,6}"))
    words = compiler.compile_sync(Constraint.choice(["alpha", "beta", "gamma"]))
    _lanes_built(digits, 2)
    _lanes_built(words, 2)
    rows: list[ConstraintMatcher | None] = []
    for i, text in enumerate(["", "1", "al", "12", "g", "123"]):  # different states
        matcher = (digits if i % 2 else words).matcher()
        assert all(matcher.accept(t) for t in tokenizer.encode(text))
        rows.append(matcher)
        if i % 3 == 0:
            rows.append(None)
    assert sorted({m.lane for m in rows if m is not None}) == [0, 1]
    masker = BatchMasker(tokenizer, len(rows), num_threads=2)
    batch = masker.fill(rows)
    assert batch is not None
    alone = BatchMasker(tokenizer, 1)
    for i, row in enumerate(batch.row_ids):
        own = alone.fill([rows[row]])
        assert own is not None
        assert torch.equal(batch.bitmask[i], own.bitmask[0]), f"row {row}"
    assert batch.row_ids == [i for i, m in enumerate(rows) if m is not None]


def test_a_slow_compile_keeps_one_lane(
    tokenizer: GrammarTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other lanes may not hold the compile thread past another timeout_s: a constraint
    whose first compile took over timeout_s / (lanes - 1) serves from its one lane."""
    real = compiler_module.build

    def slow(*args: Any) -> Any:
        time.sleep(0.3)
        return real(*args)

    monkeypatch.setattr(compiler_module, "build", slow)
    compiler = ConstraintCompiler(tokenizer, CompileConfig(timeout_s=1.0, lanes=5))  # 4 x 0.3 > 1
    compiled = compiler.compile_sync(Constraint.regex("[0-9]+"))
    deadline = time.monotonic() + 10
    while compiler.stats().running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert compiler.stats().running == 0
    assert len(compiled.lanes) == 1
    assert [compiled.matcher().lane for _ in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("waiter", ["sync", "async"])
def test_a_slow_child_start_is_not_the_constraints_time(
    tokenizer: GrammarTokenizer, monkeypatch: pytest.MonkeyPatch, waiter: str
) -> None:
    """A child's start (1.2-1.35 s on Qwen3's tokenizer, more on a loaded host) counted against
    timeout_s: a trivial constraint was refused as taking over the limit, and its start counted
    as the first compile's time, so it kept one lane (test_a_slow_compile_keeps_one_lane failed
    so under load). The limit counts from the constraint reaching a started child (the start has
    a bound of its own), the lanes from the compile here."""
    compiler = ConstraintCompiler(tokenizer, CompileConfig(timeout_s=0.5, lanes=3))
    trials = compiler._trials
    spawn = trials._spawn

    def slow_start() -> Any:
        time.sleep(1.0)  # twice the limit
        return spawn()

    monkeypatch.setattr(trials, "_spawn", slow_start)
    constraint = Constraint.regex("[0-9]+")
    if waiter == "sync":
        compiled = compiler.compile_sync(constraint)
    else:
        compiled = asyncio.run(compiler.compile(constraint))
    _lanes_built(compiled, 3)
    assert all(feed(compiled.matcher(), "42") for _ in range(3))
    compiler.close()


@pytest.mark.parametrize("waiter", ["sync", "async"])
def test_a_compile_ending_in_timeout_error_ends_its_waiters(
    tokenizer: GrammarTokenizer, monkeypatch: pytest.MonkeyPatch, waiter: str
) -> None:
    """A waiter tells its own wait running out from a compile that ended in TimeoutError (one
    class since Python 3.11): it gets that error, where it could wait again for ever."""

    def fails(*args: Any) -> Any:
        raise TimeoutError("raised by the compile")

    monkeypatch.setattr(compiler_module, "build", fails)
    compiler = ConstraintCompiler(tokenizer, CompileConfig(timeout_s=0.5))
    constraint = Constraint.regex("ab?")
    ended: list[BaseException] = []

    def wait() -> None:
        try:
            if waiter == "sync":
                compiler.compile_sync(constraint)
            else:
                asyncio.run(compiler.compile(constraint))
        except BaseException as e:
            ended.append(e)

    thread = threading.Thread(target=wait, daemon=True)  # a waiter that loops is left behind
    thread.start()
    thread.join(10)
    assert [str(e) for e in ended] == ["raised by the compile"]
    compiler.close()


def test_a_compile_process_that_cannot_start_is_unavailable_naming_the_field(
    tokenizer: GrammarTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller waits for a child's start (not the constraint's time); one that fails, here
    past its bound, reached the caller as a bare TimeoutError (INTERNAL)."""
    monkeypatch.setattr(trial_module, "START_TIMEOUT_S", 0.001)
    compiler = ConstraintCompiler(tokenizer)
    could_not = r"sampling\.regex: no constraint compile process could start \(TimeoutError\)"
    for _ in range(2):  # tried again, not remembered as the constraint's refusal
        with pytest.raises(Unavailable, match=could_not):
            compiler.compile_sync(Constraint.regex("ab?"))
    assert compiler.stats() == CompileStats(hits=0, misses=2, running=0)
    compiler.close()


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint.choice(["e\u0301"]),
        Constraint.choice(["cafe\u0301", "caf\u00e9"]),
        Constraint.regex("abc\u0301"),
        Constraint.json_schema('{"const": "cafe\\u0301"}'),
    ],
    ids=["choice", "choices-nfd-and-nfc", "regex", "const"],
)
def test_text_the_normalizer_would_change_is_forced_as_its_own_bytes(
    constraint: Constraint, compiler: ConstraintCompiler
) -> None:
    """The demo tokenizer normalizes to NFC, as Qwen3's does. A grammar forcing "e" + U+0301
    was tokenized by that normalizer into the token of "é": offered by the mask, refused by
    the matcher (INTERNAL). Every token the mask offers is accepted, and the output is the
    grammar's bytes exactly."""
    compiled = compiler.compile_sync(constraint)
    tok = compiled.tokenizer
    eos = set(tok.eos_token_ids)
    masker = BatchMasker(tok, max_batch=1)
    for seed in range(3):
        matcher = compiled.matcher()
        rng = torch.Generator().manual_seed(seed)
        out: list[int] = []
        while not matcher.is_finished:
            filled = masker.fill([matcher])
            assert filled is not None
            row = unpack_bitmask(filled.bitmask, tok.vocab_rows)[0]
            offered = row.nonzero().flatten().tolist()
            assert offered, f"nothing offered after {out}"
            token = offered[int(torch.randint(len(offered), (1,), generator=rng))]
            assert matcher.accept(token), f"offered {token} was refused after {out}"
            if token not in eos:
                out.append(token)
            assert len(out) < 40
        text = tok.decode(out)
        if constraint.kind == "json_schema":
            text = json.loads(text)
        assert text in [*constraint.choices, "abc\u0301", "cafe\u0301"]


def test_a_burst_keeps_its_compile_processes_and_a_quiet_compiler_one(
    tokenizer: GrammarTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Concurrent first compiles each take a child process (trial.py); kept while compiles
    keep coming (a start costs a second or so on Qwen3's tokenizer), all but one stopped once
    unused for IDLE_S (each holds its own tokenizer), with no compile to notice it."""

    def burst(trials: trial_module.CompileTrials) -> int:
        barrier = threading.Barrier(3)

        def compile_one(i: int) -> None:
            barrier.wait()
            trials.run(Constraint.regex(f"x{i}[a-z]{{1,{i + 2}}}"), CompileConfig())

        threads = [threading.Thread(target=compile_one, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        return trials.num_idle

    trials = trial_module.CompileTrials(tokenizer)
    started = burst(trials)
    assert started >= 2  # at least two ran at once
    trials.run(Constraint.regex("y"), CompileConfig())
    assert trials.num_idle == started  # used again within IDLE_S: all kept
    trials.close()
    assert trials.num_idle == 0
    monkeypatch.setattr(trial_module, "IDLE_S", 0.2)
    quiet = trial_module.CompileTrials(tokenizer)
    # Counted as started: on a loaded host a burst's first child can already have waited
    # IDLE_S, and been stopped, by the time the last one is given back.
    spawned: list[object] = []
    spawn = quiet._spawn

    def counted() -> object:
        spawned.append(spawn())
        return spawned[-1]

    monkeypatch.setattr(quiet, "_spawn", counted)
    burst(quiet)
    assert len(spawned) >= 2
    deadline = time.monotonic() + 5
    while quiet.num_idle > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert quiet.num_idle == 1
    quiet.close()
