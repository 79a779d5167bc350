"""Structured output through the real services (issue 31): the demo model's random weights
choose nothing sensible, so the constraint does all the work. Prefill masks the first token,
decode the rest; a finished grammar ends with STOP; bad constraints are INVALID_ARGUMENT naming
their field before any KV block is reserved."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from mili.engine.constraint.compiler import ConstraintCompiler
from mili.engine.constraint.spec import Constraint
from mili.engine.generate import generate
from mili.engine.model.loader import load_model, tokenizer_vocab_size
from mili.engine.sampling_params import SamplingParams
from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from mili.rpc.sampling import set_constraint
from mili.rpc.status import bad_request_of
from tests.e2e.conftest import Deployment
from tests.engine.constraint_helpers import demo_grammar_tokenizer

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "age": {"type": "integer", "minimum": 0, "maximum": 150},
                },
                "required": ["name", "age"],
            },
            "score": {"type": "number"},
        },
        "required": ["user"],
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["tags", "ok"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "note": {"type": "string", "maxLength": 5},
            "ratio": {"type": "number"},
            "kind": {"enum": ["a", "b", None]},
        },
        "required": ["id"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "string", "maxLength": 3}},
            "required": ["x"],
        },
        "maxItems": 2,
    },
}
SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def deployment(pipeline: Deployment) -> Deployment:
    return pipeline


@pytest.fixture(scope="module")
def hf(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))


def request(
    constraint: Constraint, *, seed: int | None = 1, temperature: float = 1.0, max_tokens: int = 160
) -> generation_pb2.CompleteRequest:
    sampling = sampling_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    set_constraint(sampling, constraint)
    return generation_pb2.CompleteRequest(prompt="Answer in JSON:", sampling=sampling)


def complete_all(
    deployment: Deployment, requests: list[generation_pb2.CompleteRequest]
) -> list[generation_pb2.CompleteResponse]:
    stub = deployment.stub()
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda r: stub.Complete(r, timeout=120), requests))


def test_json_schemas_stop_and_validate(deployment: Deployment) -> None:
    cases = [(name, seed) for name in SCHEMAS for seed in SEEDS]
    requests = [request(Constraint.json_schema(SCHEMAS[n]), seed=s) for n, s in cases]
    for (name, seed), reply in zip(cases, complete_all(deployment, requests), strict=True):
        assert reply.finish_reason == sampling_pb2.FINISH_REASON_STOP, (name, seed, reply.text)
        jsonschema.validate(json.loads(reply.text), SCHEMAS[name])


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (Constraint.regex(r"[a-z]{3}-[0-9]{2,4}"), re.compile(r"[a-z]{3}-[0-9]{2,4}").fullmatch),
        (
            Constraint.regex(r"(yes|no), because [a-z ]{1,12}\."),
            re.compile(r"(yes|no), because [a-z ]{1,12}\.").fullmatch,
        ),
        (
            Constraint.choice(["positive", "negative", "neutral"]),
            lambda t: t in ("positive", "negative", "neutral"),
        ),
        (Constraint.json_object(), lambda t: isinstance(json.loads(t), dict)),
        (
            Constraint.grammar('start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'),
            re.compile(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)").fullmatch,
        ),
        (Constraint.grammar('root ::= "id-" [0-9] [0-9]'), re.compile(r"id-[0-9]{2}").fullmatch),
    ],
    ids=["regex", "regex_words", "choice", "json_object", "lark", "gbnf"],
)
def test_other_constraints_match(
    deployment: Deployment, constraint: Constraint, check: Callable[[str], Any]
) -> None:
    replies = complete_all(deployment, [request(constraint, seed=s) for s in SEEDS])
    for reply in replies:
        # json_object is unbounded: a long one may hit max_tokens; the rest always stop
        if constraint.kind == "json_object" and reply.finish_reason != 1:
            continue
        assert reply.finish_reason == sampling_pb2.FINISH_REASON_STOP, reply.text
        assert check(reply.text), reply.text


def test_first_token_is_masked_on_prefill(deployment: Deployment, demo_model_dir: Path) -> None:
    """A one-token answer is prefill's sample alone: each must be a choice."""
    compiler = ConstraintCompiler(demo_grammar_tokenizer(demo_model_dir))
    regex = Constraint.regex(r"Z[a-z]{2,5}")
    for reply in complete_all(deployment, [request(regex, seed=s) for s in range(6)]):
        assert reply.text.startswith("Z") and reply.finish_reason == 1, reply.text
        matcher = compiler.compile_sync(regex).matcher()
        assert matcher.allowed(reply.token_ids[0])
    # max_tokens 1: the only token is prefill's
    one = [request(regex, seed=s, max_tokens=1) for s in range(4)]
    for reply in complete_all(deployment, one):
        assert len(reply.token_ids) == 1 and reply.text.startswith("Z"), reply.text


def test_greedy_constrained_equals_single_process(
    deployment: Deployment, demo_model_dir: Path
) -> None:
    schema = Constraint.json_schema(SCHEMAS["array_enum"])  # bounded even greedily
    token_ids = [5, 77, 300, 12, 9]
    sampling = sampling_pb2.SamplingParams(max_tokens=120, temperature=0)
    set_constraint(sampling, schema)
    reply = deployment.stub().Complete(
        generation_pb2.CompleteRequest(token_ids=token_ids, sampling=sampling), timeout=60
    )
    model = load_model(demo_model_dir, dtype=torch.float32)
    compiler = ConstraintCompiler(demo_grammar_tokenizer(demo_model_dir))
    params = SamplingParams(temperature=0, max_tokens=120, constraint=schema)
    vocab = tokenizer_vocab_size(demo_model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = generate(model, [token_ids], params, vocab_size=vocab, compiler=compiler)[0]
    finally:
        torch.set_num_threads(threads)
    assert list(reply.token_ids) == ref.token_ids
    assert reply.finish_reason == sampling_pb2.FINISH_REASON_STOP and ref.finish_reason == "stop"


@pytest.mark.parametrize(
    ("constraint", "field", "words"),
    [
        (Constraint.json_schema("{not json"), "sampling.json_schema", "not valid JSON"),
        (
            Constraint.json_schema({"type": "string", "not": {"maxLength": 2}}),
            "sampling.json_schema",
            "not",
        ),
        (
            Constraint.json_schema({"type": "object", "properties": {"a": {"type": "nope"}}}),
            "sampling.json_schema",
            "",
        ),
        (
            Constraint.json_schema({"type": "string", "format": "no-such"}),
            "sampling.json_schema",
            "",
        ),
        (Constraint.grammar("start: ( unclosed"), "sampling.grammar", ""),
        (Constraint.grammar("start: <|im_end|>"), "sampling.grammar", "an end-of-sequence token"),
        (Constraint.regex("(unbalanced"), "sampling.regex", ""),
        (Constraint.regex("a" * 5000), "sampling.regex", "at most"),
        (
            Constraint.json_schema({"description": "x" * 70_000}),
            "sampling.json_schema",
            "at most",
        ),
        (Constraint.choice([""]), "sampling.choice.choices[0]", ""),
    ],
    ids=[
        "json",
        "unsupported",
        "bad_type",
        "format",
        "grammar",
        "grammar_eos",
        "regex",
        "regex_size",
        "schema_size",
        "empty_choice",
    ],
)
def test_bad_constraints_are_invalid_argument(
    deployment: Deployment, constraint: Constraint, field: str, words: str
) -> None:
    before = deployment.settled_free_blocks()
    with pytest.raises(grpc.RpcError) as info:
        deployment.stub().Complete(request(constraint), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    bad = bad_request_of(info.value)
    assert bad is not None
    assert [v.field for v in bad.field_violations] == [field]
    assert words in bad.field_violations[0].description
    assert deployment.free_blocks() == before  # refused before any block was reserved
    # the service still serves the next (constrained) request
    ok = deployment.stub().Complete(request(Constraint.choice(["a", "b"])), timeout=30)
    assert ok.text in ("a", "b") and ok.finish_reason == sampling_pb2.FINISH_REASON_STOP


def test_a_grammar_that_reaches_an_end_of_sequence_token_it_names_is_invalid_argument(
    deployment: Deployment,
) -> None:
    """It compiles (its start is fine) and decode reaches the token it names: an empty mask
    there was a garbage draw and INTERNAL; now INVALID_ARGUMENT naming the field, every block
    back."""
    before = deployment.settled_free_blocks()
    grammar = Constraint.grammar('start: "yes, " NUM " times" <|im_end|>\nNUM: /[0-9]/')
    with pytest.raises(grpc.RpcError) as info:
        deployment.stub().Complete(request(grammar), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    bad = bad_request_of(info.value)
    assert bad is not None and [v.field for v in bad.field_violations] == ["sampling.grammar"]
    assert "no token can continue it after" in bad.field_violations[0].description
    assert deployment.settled_free_blocks() == before
