"""tool_choice required / named -> a grammar, compiled on the demo tokenizer and sampled from
random logits (the constraint, not a model, does the work): every output, read back through
ChatOutput as the APIs read it, is one or more valid calls of an offered tool whose arguments
validate against its parameters, and nothing else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from tokenizers import Tokenizer

from mili.engine.constraint.compiler import CompiledConstraint, ConstraintCompiler
from mili.engine.constraint.spec import ThinkBlock
from mili.engine.constraint.vocab import GrammarTokenizer
from mili.errors import InvalidArgument
from services.frontend.chat_output import ChatOutput
from services.frontend.tool_grammar import tool_call_constraint
from services.frontend.tools import FunctionTool, ToolChoice
from tests.engine.constraint_helpers import demo_grammar_tokenizer, sample, sample_biased

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city"],
}
SEARCH = {
    "type": "object",
    "properties": {
        "terms": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "exact": {"type": "boolean"},
    },
    "required": ["terms", "exact"],
}
TOOLS = [
    FunctionTool("get_weather", "Weather in a city", json.dumps(WEATHER)),
    FunctionTool("search", "", json.dumps(SEARCH)),
    FunctionTool("now"),  # no parameters: arguments {}
]
SCHEMAS: dict[str, dict[str, Any]] = {
    "get_weather": WEATHER,
    "search": SEARCH,
    "now": {"type": "object", "maxProperties": 0},
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


def compiled(
    compiler: ConstraintCompiler, choice: ToolChoice, think: ThinkBlock = "none", **kwargs: Any
) -> CompiledConstraint:
    """The tool choice's constraint behind `think` (what the frontend adds for chat with
    thinking on: prompt.with_think_block), compiled."""
    constraint = tool_call_constraint(TOOLS, choice, **kwargs)
    assert constraint is not None and constraint.kind == "grammar"
    return compiler.compile_sync(constraint.after_think(think))


def calls_of(text: str) -> tuple[str, str, list[tuple[str, dict[str, Any]]]]:
    """(reasoning, content, calls) as the APIs read the text."""
    output = ChatOutput(is_parsing_tools=True)
    piece = output.push(text, is_last=True)
    calls = [(c.name, json.loads(c.arguments)) for c in piece.tool_calls]
    return piece.reasoning, piece.content, calls


def check_calls(text: str, names: set[str], max_calls: int | None) -> int:
    reasoning, content, calls = calls_of(text)
    assert content == "", text
    assert reasoning == "", text
    assert 1 <= len(calls) <= (max_calls or len(calls)), text
    for name, arguments in calls:
        assert name in names, text
        jsonschema.validate(arguments, SCHEMAS[name])
    # Qwen3's own spelling of a call, as its template renders one back.
    assert text.startswith('<tool_call>\n{"name": "'), text
    return len(calls)


@pytest.mark.parametrize("is_parallel", [True, False])
def test_required_outputs_are_valid_calls(
    is_parallel: bool, compiler: ConstraintCompiler, hf: Tokenizer
) -> None:
    grammar = compiled(compiler, ToolChoice("required"), is_parallel=is_parallel)
    names: set[str] = set()
    num_calls = []
    for seed in range(4):
        run = sample(grammar, hf, seed, max_steps=600)
        assert all(run.finished), run.steps
        for text in run.texts:
            num_calls.append(check_calls(text, set(SCHEMAS), None if is_parallel else 1))
            names |= {name for name, _ in calls_of(text)[2]}
    assert names == set(SCHEMAS)  # random draws reach every tool
    assert (max(num_calls) > 1) == is_parallel


def test_named_function_outputs_call_it(compiler: ConstraintCompiler, hf: Tokenizer) -> None:
    grammar = compiled(compiler, ToolChoice("function", "search"))
    for seed in range(3):
        run = sample(grammar, hf, seed, max_steps=600)
        assert all(run.finished)
        for text in run.texts:
            check_calls(text, {"search"}, None)


def test_a_tool_with_defs_and_refs_is_called_with_valid_arguments(
    compiler: ConstraintCompiler, hf: Tokenizer
) -> None:
    """Parameters with `$defs` and `$ref` (pydantic's nested models, openai's
    pydantic_function_tool): their references still resolve inside the call's schema (they
    pointed at the call's root, which has no `$defs`: every forced call of such a tool was a
    400)."""
    address = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}},
        "required": ["city"],
    }
    ship = {
        "$defs": {"Addr": address},
        "type": "object",
        "properties": {"to": {"$ref": "#/$defs/Addr"}, "n": {"type": "integer", "maximum": 9}},
        "required": ["to", "n"],
    }
    tool = FunctionTool("ship", "", json.dumps(ship))
    constraint = tool_call_constraint([tool], ToolChoice("function", "ship"))
    assert constraint is not None
    grammar = compiler.compile_sync(constraint)
    for seed in range(3):
        run = sample(grammar, hf, seed, max_steps=600)
        assert all(run.finished)
        for text in run.texts:
            calls = calls_of(text)[2]
            assert calls, text
            for name, arguments in calls:
                assert name == "ship"
                jsonschema.validate(arguments, ship)


@pytest.mark.parametrize(
    "parameters",
    [{}, {"properties": {"a": {"type": "integer", "maximum": 9}}, "required": ["a"]}],
)
def test_parameters_without_a_type_are_called_with_an_object(
    compiler: ConstraintCompiler,
    tokenizer: GrammarTokenizer,
    hf: Tokenizer,
    parameters: dict[str, Any],
) -> None:
    """Parameters that name no type (read as an object, as OpenAI reads them): the arguments
    are still an object. The schema was embedded as sent, which allows any JSON value, and
    `"arguments": true` is no call: the answer came back as text with no tool_calls."""
    tool = FunctionTool("f", "", json.dumps(parameters))
    constraint = tool_call_constraint([tool], ToolChoice("function", "f"))
    assert constraint is not None
    grammar = compiler.compile_sync(constraint)
    for value in ("true", "null", "-6045", '"a"', "[1]"):
        call = f'<tool_call>\n{{"name": "f", "arguments": {value}}}\n</tool_call>'
        assert not accepts(grammar, tokenizer, call), value
    if parameters:  # {} allows any object: random draws would write keys for long
        for seed in range(3):
            run = sample(grammar, hf, seed, max_steps=600)
            assert all(run.finished)
            for text in run.texts:
                _, content, calls = calls_of(text)
                assert content == "" and calls and all(name == "f" for name, _ in calls), text
                for _, arguments in calls:
                    jsonschema.validate(arguments, {"type": "object", **parameters})
    else:
        call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
        assert accepts(grammar, tokenizer, call)


@pytest.mark.parametrize(
    "parameters",
    [
        {  # an embedded resource: its refs resolve against its $id, not the call's root
            "$id": "https://example.com/ship.json",
            "type": "object",
            "properties": {"to": {"$ref": "#/$defs/A"}},
            "required": ["to"],
            "$defs": {"A": {"type": "integer", "maximum": 9}},
        },
        {  # a plain-name anchor
            "type": "object",
            "properties": {"to": {"$ref": "#a"}},
            "required": ["to"],
            "$defs": {"A": {"$anchor": "a", "type": "integer", "maximum": 9}},
        },
    ],
)
def test_ids_and_anchors_in_parameters_still_resolve(
    compiler: ConstraintCompiler, tokenizer: GrammarTokenizer, parameters: dict[str, Any]
) -> None:
    tool = FunctionTool("ship", "", json.dumps(parameters))
    constraint = tool_call_constraint([tool], ToolChoice("function", "ship"))
    assert constraint is not None
    grammar = compiler.compile_sync(constraint)
    call = '<tool_call>\n{"name": "ship", "arguments": {"to": 3}}\n</tool_call>'
    assert accepts(grammar, tokenizer, call)


def test_thinking_on_allows_a_think_block_then_requires_calls(
    compiler: ConstraintCompiler, tokenizer: GrammarTokenizer, hf: Tokenizer
) -> None:
    grammar = compiled(compiler, ToolChoice("function", "get_weather"), "optional")
    think_id, close_id = tokenizer.encode("<think>")[0], tokenizer.encode("</think>")[0]
    texts = sample_biased(grammar, hf, seed=0, bias={think_id: 4.0, close_id: 6.0})
    thought = 0
    for text in texts:
        reasoning, content, calls = calls_of(text)
        assert content == "" and calls and all(n == "get_weather" for n, _ in calls), text
        assert bool(reasoning) <= text.startswith("<think>"), text
        for _, arguments in calls:
            jsonschema.validate(arguments, WEATHER)
        thought += text.startswith("<think>")
    assert thought > 0  # thinking was allowed, and a call still followed


def test_a_matcher_takes_a_real_answer_and_refuses_others(
    compiler: ConstraintCompiler, tokenizer: GrammarTokenizer
) -> None:
    grammar = compiled(compiler, ToolChoice("required"), "optional")
    good = (
        "<think>\nParis, so get_weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    )
    bad = [
        'Sure.<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',  # text first
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',  # no such tool
        '<tool_call>\n{"name": "search", "arguments": {"terms": []}}\n</tool_call>',  # required
        '<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>',  # not Qwen3's spelling
    ]
    assert accepts(grammar, tokenizer, good)
    for text in bad:
        assert not accepts(grammar, tokenizer, text), text


def test_auto_and_none_enforce_nothing() -> None:
    assert tool_call_constraint(TOOLS, ToolChoice("auto")) is None
    assert tool_call_constraint(TOOLS, ToolChoice("none")) is None


def test_bounds_the_library_would_not_enforce_are_refused_naming_the_tool() -> None:
    """As for a json_schema constraint (schema.unenforced_bounds): a forced call of this tool
    could have carried `"x": 100`, which its parameters forbid. Only enforced tools count."""
    parameters = {
        "type": "object",
        "properties": {"x": {"type": "number", "exclusiveMinimum": 100, "maximum": 100.5}},
    }
    tools = [*TOOLS, FunctionTool("odd", "", json.dumps(parameters))]
    with pytest.raises(InvalidArgument) as caught:
        tool_call_constraint(tools, ToolChoice("required"))
    (violation,) = caught.value.violations
    assert violation.field == "tools[3].parameters"
    assert "exclusiveMinimum 100 with maximum 100.5" in violation.description
    assert tool_call_constraint(tools, ToolChoice("function", "search")) is not None


def test_tools_over_the_size_limit_are_refused_naming_tools() -> None:
    big = FunctionTool("big", "", json.dumps({"type": "object", "description": "x" * 70_000}))
    with pytest.raises(InvalidArgument) as caught:
        tool_call_constraint([big], ToolChoice("required"))
    assert caught.value.violations[0].field == "tools"


def accepts(grammar: CompiledConstraint, tokenizer: GrammarTokenizer, text: str) -> bool:
    matcher = grammar.matcher()
    ids = tokenizer.encode(text)
    return all(matcher.accept(t) for t in ids) and matcher.can_finish
