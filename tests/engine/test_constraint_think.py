"""A constraint behind Qwen3's think block (mili.engine.constraint.think), compiled on the demo
tokenizer: the matcher takes a think block, then exactly the constraint's text; without the
block it is the constraint alone; sampled from random logits and read through ChatOutput as
the APIs read it, the content is the constrained answer and the thinking is split off."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from tokenizers import Tokenizer

from mili.engine.constraint.compiler import CompiledConstraint, ConstraintCompiler
from mili.engine.constraint.spec import Constraint, ThinkBlock
from mili.engine.constraint.vocab import GrammarTokenizer
from mili.errors import InvalidArgument, ResourceExhausted
from services.frontend.chat_output import ChatOutput
from tests.engine.constraint_helpers import demo_grammar_tokenizer, sample_biased

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
ANSWER = '{"city":"Paris","days":3}'
THOUGHT = "<think>\nThe user wants JSON.\n</think>\n\n"
# (constraint, an answer it takes, text it refuses)
KINDS = [
    (Constraint.json_schema(SCHEMA), ANSWER, '{"city":"Paris"}'),
    (Constraint.json_object(), '{"a":[1]}', "[1]"),
    (Constraint.regex("[0-9]{3}-[a-z]+"), "123-abc", "12-abc"),
    (Constraint.choice(["yes", "no"]), "no", "maybe"),
    (Constraint.grammar('start: "x" NUM\nNUM: /[0-9]+/'), "x42", "y42"),
    (Constraint.grammar('root ::= "x" [0-9]+'), "x42", "x"),  # GBNF
]


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> GrammarTokenizer:
    return demo_grammar_tokenizer(demo_model_dir)


@pytest.fixture(scope="module")
def hf(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def compiler(tokenizer: GrammarTokenizer) -> ConstraintCompiler:
    return ConstraintCompiler(tokenizer)


def accepts(compiled: CompiledConstraint, token_ids: list[int]) -> bool:
    """Whether the matcher takes `token_ids` and can end after them."""
    matcher = compiled.matcher()
    return all(matcher.accept(t) for t in token_ids) and matcher.can_finish


def ids(tokenizer: GrammarTokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)  # tags as their single tokens, as Qwen3 writes them


@pytest.mark.parametrize(("constraint", "answer", "refused"), KINDS)
def test_thinking_first_then_exactly_the_constraint(
    compiler: ConstraintCompiler,
    tokenizer: GrammarTokenizer,
    constraint: Constraint,
    answer: str,
    refused: str,
) -> None:
    optional = compiler.compile_sync(constraint.after_think("optional"))
    assert accepts(optional, ids(tokenizer, THOUGHT + answer))
    assert accepts(optional, ids(tokenizer, answer))  # no block: the constraint from the start
    assert accepts(optional, ids(tokenizer, "<think>\n\n</think>\n\n" + answer))
    assert not accepts(optional, ids(tokenizer, THOUGHT + refused))
    assert not accepts(optional, ids(tokenizer, THOUGHT + "junk " + answer))
    assert not accepts(optional, ids(tokenizer, THOUGHT + THOUGHT + answer))  # one block only
    assert not accepts(optional, ids(tokenizer, "thinking\n</think>\n\n" + answer))
    assert not accepts(optional, ids(tokenizer, "<think>\nno end " + answer))
    # The prompt opened the block: the output starts inside it.
    opened = compiler.compile_sync(constraint.after_think("open"))
    assert accepts(opened, ids(tokenizer, "The user wants JSON.\n</think>\n\n" + answer))
    assert not accepts(opened, ids(tokenizer, answer))  # the block must close first
    assert not accepts(opened, ids(tokenizer, THOUGHT + answer))  # no second <think>
    assert not accepts(opened, ids(tokenizer, "x</think>\n\n" + refused))
    # Thinking off, and prompts: constrained from the first token, as before.
    plain = compiler.compile_sync(constraint)
    assert accepts(plain, ids(tokenizer, answer))
    assert not accepts(plain, ids(tokenizer, THOUGHT + answer))


def test_a_think_tag_spelled_in_pieces_does_not_end_the_block(
    compiler: ConstraintCompiler, tokenizer: GrammarTokenizer
) -> None:
    """The reasoning is any text but a tag spelled out: the frontend's splitter would read that
    as the block's end while the grammar still took it as reasoning."""
    compiled = compiler.compile_sync(Constraint.json_schema(SCHEMA).after_think("optional"))
    spelled = [*ids(tokenizer, "<think>\nab"), *ids(tokenizer, "</"), *ids(tokenizer, "think>")]
    assert len(spelled) > len(ids(tokenizer, "<think>\nab</think>"))  # no </think> token in it
    matcher = compiled.matcher()
    assert not all(matcher.accept(t) for t in spelled)


def test_each_think_block_is_a_grammar_of_its_own(compiler: ConstraintCompiler) -> None:
    """Keyed apart in the compile cache: the same schema with and without the block."""
    constraint = Constraint.json_schema(SCHEMA)
    keys = {constraint.after_think(t).key for t in ("none", "optional", "open")}
    assert len(keys) == 3 and constraint.after_think("none") == constraint
    for think in ("none", "optional", "open"):
        assert compiler.compile_sync(constraint.after_think(think)).constraint.think == think


def test_a_schema_error_still_names_the_schema(compiler: ConstraintCompiler) -> None:
    """Behind a think block, a bad schema is still refused naming `sampling.json_schema`."""
    bad = Constraint.json_schema({"type": "object", "not": {"required": ["a"]}})
    with pytest.raises(InvalidArgument) as err:
        compiler.compile_sync(bad.after_think("optional"))
    assert [v.field for v in err.value.violations] == ["sampling.json_schema"]


@pytest.mark.parametrize(
    ("grammar", "words"),
    [
        ('start: "a" start', "the text it forces at its start never ends"),
        ("start: <|im_end|>", "no token can continue it at its start: it asks for <|im_end|>"),
    ],
)
@pytest.mark.parametrize("think", ["optional", "open"])
def test_a_dead_end_after_the_think_block_is_refused_at_compile(
    compiler: ConstraintCompiler, grammar: str, words: str, think: ThinkBlock
) -> None:
    """Behind a think block the start state always has a way on (the block): a grammar that
    thinking off refuses at compile went through, and failed only once the model had thought
    (mid-stream, after a 200), or never (its reasoning ran to max_tokens)."""
    for shape in ("none", think):
        with pytest.raises(InvalidArgument) as err:
            compiler.compile_sync(Constraint.grammar(grammar).after_think(shape))
        (violation,) = err.value.violations
        assert violation.field == "sampling.grammar"
        assert words in violation.description


@pytest.mark.parametrize("think", ["optional", "open"])
def test_a_constraint_too_big_alone_is_too_big_behind_the_think_block(
    compiler: ConstraintCompiler, think: ThinkBlock
) -> None:
    """llguidance builds a nested grammar's lexer only when the output reaches it: behind the
    block, a regex whose compile takes over the memory limit compiled in a moment, and its
    lexer was built in decode's step once the model had thought."""
    big = Constraint.regex("b{1000}{200}")
    for shape in ("none", think):
        with pytest.raises(ResourceExhausted, match=r"sampling\.regex: .* over 64 MiB of memory"):
            compiler.compile_sync(big.after_think(shape))


def test_a_compiled_constraint_behind_the_think_block_takes_the_block_and_its_answer(
    compiler: ConstraintCompiler, tokenizer: GrammarTokenizer
) -> None:
    """Built lazily, this regex's lexer used up llguidance's lexer limits, which the copies of
    a compile share: the first request thought, then failed at its answer's first token
    (RESOURCE_EXHAUSTED), every later one at its first token. Refused at compile instead, or
    usable: never compiled and unusable."""
    regex = Constraint.regex("b{1000}{100}")
    assert compiler.compile_sync(regex).matcher().accept(ids(tokenizer, "b")[0])  # alone: fine
    try:
        compiled = compiler.compile_sync(regex.after_think("optional"))
    except ResourceExhausted as err:
        assert str(err).startswith("sampling.regex: the constraint is too complex")
        return
    for _ in range(2):
        matcher = compiled.matcher()
        assert all(matcher.accept(t) for t in ids(tokenizer, "<think>hm</think>\n\nb"))


@pytest.mark.parametrize("think", ["optional", "open"])
def test_sampled_answers_split_into_reasoning_and_valid_json(
    compiler: ConstraintCompiler, tokenizer: GrammarTokenizer, hf: Tokenizer, think: ThinkBlock
) -> None:
    compiled = compiler.compile_sync(Constraint.json_schema(SCHEMA).after_think(think))
    think_id, close_id = ids(tokenizer, "<think>")[0], ids(tokenizer, "</think>")[0]
    texts = sample_biased(compiled, hf, seed=0, bias={think_id: 4.0, close_id: 6.0})
    num_thought = 0
    for text in texts:
        output = ChatOutput(is_parsing_tools=False, is_constrained=True)
        piece = output.push(text, is_last=True, starts_in_reasoning=think == "open")
        jsonschema.validate(json.loads(piece.content), SCHEMA)
        assert "think>" not in piece.reasoning, text
        num_thought += "</think>" in text
    assert num_thought > 0  # a block was written, and valid JSON still followed
