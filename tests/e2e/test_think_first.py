"""Structured output that lets Qwen3 think first, through the real services on the demo model:
a chat with thinking on may open a think block before its constrained answer (the constraint
applies after it), its reasoning comes back apart and its content is exactly the constrained
answer, on HTTP (whole and streamed) and gRPC alike; thinking off and completions are
constrained from their first token. The random model writes `<think>` only when favoured
(logit_bias), which a constraint from the first token never lets it write."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from mili.engine.constraint.spec import Constraint
from mili.pb.common.v1 import chat_pb2, sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from mili.rpc.sampling import set_constraint
from mili.rpc.status import bad_request_of
from tests.e2e.conftest import Deployment

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
ASK = [{"role": "user", "content": "Weather in Paris, as JSON?"}]
SEEDS = range(4)


@pytest.fixture(scope="module")
def client(pipeline: Deployment) -> openai.OpenAI:
    url = pipeline.frontend.http_url
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tags(demo_model_dir: Path) -> tuple[int, int]:
    """The ids of <think> and </think> (one token each)."""
    hf = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    think, close = hf.token_to_id("<think>"), hf.token_to_id("</think>")
    assert think is not None and close is not None
    return think, close


def bias(tags: tuple[int, int]) -> dict[int, float]:
    """<think> all but forced where allowed, </think> favoured: a short block of random text
    (unfavoured, the demo model's block runs past any max_tokens)."""
    return {tags[0]: 100.0, tags[1]: 2.0}


def http_chat(client: openai.OpenAI, tags: tuple[int, int], seed: int, **args: Any) -> Any:
    args.setdefault("messages", ASK)
    return client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=1.0, seed=seed, max_tokens=300,
        logit_bias={str(t): b for t, b in bias(tags).items()}, **args,
    )  # fmt: skip


def test_http_chat_thinks_then_answers_valid_json(
    client: openai.OpenAI, tags: tuple[int, int]
) -> None:
    """The constraint held from the first token: the model was made to write "{" where it
    writes <think>, and no reasoning ever came back."""
    num_reasoned = 0
    for seed in SEEDS:
        (done,) = http_chat(client, tags, seed, response_format=RESPONSE_FORMAT).choices
        assert done.finish_reason == "stop", done
        jsonschema.validate(json.loads(done.message.content), SCHEMA)
        reasoning = getattr(done.message, "reasoning_content", None)
        assert reasoning is None or "think>" not in reasoning
        num_reasoned += bool(reasoning)
        streamed = list(http_chat(client, tags, seed, response_format=RESPONSE_FORMAT, stream=True))
        deltas = [c.choices[0].delta for c in streamed if c.choices]
        assert "".join(d.content or "" for d in deltas) == done.message.content
        streamed_reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        assert streamed_reasoning == (reasoning or "")
    assert num_reasoned > 0  # it thought before some answers


def grpc_chat(
    pipeline: Deployment,
    tags: tuple[int, int],
    constraint: Constraint,
    seed: int,
    **fields: Any,
) -> generation_pb2.CompleteResponse:
    sampling = sampling_pb2.SamplingParams(
        max_tokens=300, temperature=1.0, seed=seed, logit_bias=bias(tags)
    )
    set_constraint(sampling, constraint)
    if "prompt" not in fields:
        fields["messages"] = [
            chat_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in ASK
        ]
    request = generation_pb2.CompleteRequest(sampling=sampling, **fields)
    return pipeline.stub().Complete(request, timeout=60)


def is_weather(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (Constraint.json_schema(SCHEMA), is_weather),
        (Constraint.regex("[0-9]{2}-[a-z]{1,4}"), re.compile("[0-9]{2}-[a-z]{1,4}").fullmatch),
        (Constraint.choice(["yes", "no"]), ("yes", "no").__contains__),
    ],
)
def test_grpc_chat_thinks_then_answers_the_constraint(
    pipeline: Deployment, tags: tuple[int, int], constraint: Constraint, check: Any
) -> None:
    for seed in SEEDS:
        reply = grpc_chat(pipeline, tags, constraint, seed)
        assert reply.finish_reason == sampling_pb2.FINISH_REASON_STOP
        assert reply.token_ids[0] == tags[0]  # it opened a think block
        assert check(reply.text), reply.text
        assert "think>" not in reply.reasoning_text


def test_thinking_off_and_completions_are_constrained_from_the_first_token(
    pipeline: Deployment, client: openai.OpenAI, tags: tuple[int, int]
) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    for seed in SEEDS[:2]:
        (done,) = http_chat(
            client, tags, seed, response_format=RESPONSE_FORMAT, extra_body=off
        ).choices
        jsonschema.validate(json.loads(done.message.content), SCHEMA)
        assert getattr(done.message, "reasoning_content", None) is None
        reply = grpc_chat(
            pipeline, tags, Constraint.json_schema(SCHEMA), seed, enable_thinking=False
        )
        assert tags[0] not in reply.token_ids and reply.reasoning_text == ""
        jsonschema.validate(json.loads(reply.text), SCHEMA)
        prompt = grpc_chat(pipeline, tags, Constraint.json_schema(SCHEMA), seed, prompt="JSON:")
        assert tags[0] not in prompt.token_ids
        jsonschema.validate(json.loads(prompt.text), SCHEMA)
        completion = client.completions.create(
            model=client.models.list().data[0].id, prompt="JSON:", seed=seed, max_tokens=300,
            logit_bias={str(t): b for t, b in bias(tags).items()},
            extra_body={"response_format": RESPONSE_FORMAT},
        )  # fmt: skip
        jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)


def test_a_forced_tool_choice_thinks_then_calls(
    client: openai.OpenAI, tags: tuple[int, int]
) -> None:
    """The tool choice's constraint goes behind the same think block as any chat constraint."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
    for seed in SEEDS[:2]:
        (done,) = http_chat(client, tags, seed, tools=[tool], tool_choice="required").choices
        assert done.finish_reason == "tool_calls" and not done.message.content, done
        for call in done.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
        assert "think>" not in (getattr(done.message, "reasoning_content", None) or "")


def test_a_grammar_at_a_dead_end_after_the_think_block_is_refused_up_front(
    client: openai.OpenAI, tags: tuple[int, int]
) -> None:
    """Refused before any token, as with thinking off: it compiled, the model thought, and the
    request failed only then (streamed: after the 200 and the reasoning), or its reasoning ran
    to max_tokens and no error came at all."""
    for stream in (True, False):
        with pytest.raises(openai.BadRequestError) as err:
            http_chat(
                client, tags, 0, stream=stream, extra_body={"guided_grammar": "start: <|im_end|>"}
            )
        assert "no token can continue it at its start" in err.value.message


def test_a_regex_too_big_to_compile_is_refused_with_thinking_on(
    client: openai.OpenAI, tags: tuple[int, int]
) -> None:
    """Refused as with thinking off: behind the think block llguidance built the regex's lexer
    only once the output reached it, so it compiled, and the request failed after thinking."""
    with pytest.raises(openai.BadRequestError) as err:
        http_chat(client, tags, 0, extra_body={"guided_regex": "b{1000}{200}"})
    assert "over 64 MiB of memory" in err.value.message


def test_a_callers_think_block_is_refused(pipeline: Deployment) -> None:
    """The frontend sets it from enable_thinking and the chat template, never a caller."""
    sampling = sampling_pb2.SamplingParams(
        max_tokens=4, json_object=True, think_block=sampling_pb2.THINK_BLOCK_OPTIONAL
    )
    request = generation_pb2.CompleteRequest(prompt="JSON:", sampling=sampling)
    with pytest.raises(grpc.RpcError) as err:
        pipeline.stub().Complete(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations = bad_request_of(err.value).field_violations  # type: ignore[arg-type]
    assert [v.field for v in violations] == ["sampling.think_block"]
    # What to do instead, and the value by the name the caller wrote (grpcurl: the enum's)
    assert "enable_thinking" in violations[0].description
    assert violations[0].description.endswith("(got 'THINK_BLOCK_OPTIONAL')")
