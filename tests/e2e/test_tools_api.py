"""Tools and reasoning on both APIs, end to end on the demo model (random weights, float32):
tools reach the prompt, tool calls and results are taken back, a chat's thinking comes apart
from its answer on gRPC exactly as on HTTP (one implementation), streamed equals whole, and bad
tools are refused naming the parameter. The random model never writes a <tool_call> on its own:
tool_choice required or named forces one, with the constraint prefill and decode enforce."""

from __future__ import annotations

import json
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from mili.pb.common.v1 import chat_pb2, sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from mili.pb.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mili.rpc.status import bad_request_of
from services.frontend.reasoning import ReasoningSplitter
from tests.e2e.conftest import Deployment

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    # Bounded, so that greedy output ends too (an unbounded integer may take every token).
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 0, "maximum": 14},
    },
    "required": ["city"],
}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
GRPC_TOOL = chat_pb2.Tool(name="get_weather", parameters=json.dumps(WEATHER))
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# An earlier call and its result, sent back as OpenAI clients send them.
CALLED = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
]


@pytest.fixture(scope="module")
def client(pipeline: Deployment) -> openai.OpenAI:
    url = pipeline.frontend.http_url
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client: openai.OpenAI, **args: Any) -> Any:
    args.setdefault("messages", ASK)
    args.setdefault("max_tokens", 12)
    args.setdefault("temperature", 0)
    return client.chat.completions.create(model=model_of(client), **args)


def forced_calls(client: openai.OpenAI, tool: Any, choice: Any, *, num_seeds: int) -> list[Any]:
    """The calls of `num_seeds` sampled answers (temperature 1, thinking off) under a forced
    `choice`: each answer must be calls alone, finish reason tool_calls."""
    calls = []
    for seed in range(num_seeds):
        reply = chat(
            client, tools=[tool], tool_choice=choice, temperature=1.0, seed=seed,
            max_tokens=200, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )  # fmt: skip
        (done,) = reply.choices
        assert done.finish_reason == "tool_calls", done
        assert done.message.tool_calls and not done.message.content
        calls += done.message.tool_calls
    return calls


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def grpc_complete(
    pipeline: Deployment, max_tokens: int = 12, **fields: Any
) -> generation_pb2.CompleteResponse:
    fields.setdefault("messages", [chat_pb2.ChatMessage(role="user", content="Weather in Paris?")])
    fields.setdefault("sampling", sampling_pb2.SamplingParams(max_tokens=max_tokens, temperature=0))
    request = generation_pb2.CompleteRequest(**fields)
    return pipeline.stub().Complete(request, timeout=60)


def test_tools_reach_the_prompt_and_calls_and_results_come_back(
    pipeline: Deployment, client: openai.OpenAI
) -> None:
    bare = chat(client)
    offered = chat(client, tools=[TOOL])
    assert offered.usage.prompt_tokens > bare.usage.prompt_tokens + 20  # the tools' listing
    grpc_offered = grpc_complete(pipeline, tools=[GRPC_TOOL])
    assert grpc_offered.usage.prompt_tokens == offered.usage.prompt_tokens
    answered = chat(client, tools=[TOOL], messages=CALLED)
    assert answered.usage.prompt_tokens > offered.usage.prompt_tokens  # the call and its result
    grpc_answered = grpc_complete(
        pipeline,
        tools=[GRPC_TOOL],
        messages=[
            chat_pb2.ChatMessage(role="user", content="Weather in Paris?"),
            chat_pb2.ChatMessage(
                role="assistant",
                tool_calls=[
                    chat_pb2.ToolCall(
                        id="call_1", name="get_weather", arguments='{"city": "Paris"}'
                    )
                ],
            ),
            chat_pb2.ChatMessage(role="tool", content='{"sky": "clear"}', tool_call_id="call_1"),
        ],
    )
    assert grpc_answered.usage.prompt_tokens == answered.usage.prompt_tokens
    assert grpc_answered.text == answered.choices[0].message.content
    # tool_choice none still lists the tools; the answer is plain text. (The same prompt again:
    # its cached tokens differ.)
    usage, offered_usage = chat(client, tools=[TOOL], tool_choice="none").usage, offered.usage
    assert usage is not None and offered_usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        offered_usage.prompt_tokens,
        offered_usage.completion_tokens,
    )


@pytest.mark.parametrize("enable_thinking", [None, False])
def test_grpc_reasoning_text_equals_http_reasoning_content(
    pipeline: Deployment, client: openai.OpenAI, enable_thinking: bool | None
) -> None:
    kwargs: dict[str, Any] = {}
    fields: dict[str, Any] = {}
    if enable_thinking is not None:
        kwargs["extra_body"] = {"chat_template_kwargs": {"enable_thinking": enable_thinking}}
        fields["enable_thinking"] = enable_thinking
    message = chat(client, max_tokens=24, **kwargs).choices[0].message
    whole = grpc_complete(pipeline, max_tokens=24, **fields)
    reasoning = getattr(message, "reasoning_content", None)
    assert (whole.text, whole.reasoning_text or None) == (message.content, reasoning)
    # The split is of the text the model wrote: the same prompt's ids, not split, say so.
    with grpc.insecure_channel(pipeline.tokenizer.address) as channel:
        tokenize = tokenizer_pb2_grpc.TokenizerServiceStub(channel).Tokenize
        asked = tokenizer_pb2.TokenizeRequest(
            messages=[chat_pb2.ChatMessage(role="user", content="Weather in Paris?")], **fields
        )
        ids = tokenize(asked, timeout=10).token_ids
    raw = pipeline.stub().Complete(
        generation_pb2.CompleteRequest(
            token_ids=ids, sampling=sampling_pb2.SamplingParams(max_tokens=24, temperature=0)
        ),
        timeout=60,
    )
    splitter = ReasoningSplitter()
    r1, c1 = splitter.push(raw.text)
    r2, c2 = splitter.finish()
    assert (whole.reasoning_text, whole.text) == (r1 + r2, c1 + c2)
    # Streamed: the messages' reasoning and text add up to the whole reply's.
    stream = pipeline.stub().Generate(
        generation_pb2.GenerateRequest(
            messages=[chat_pb2.ChatMessage(role="user", content="Weather in Paris?")],
            sampling=sampling_pb2.SamplingParams(max_tokens=24, temperature=0),
            **fields,
        ),
        timeout=60,
    )
    messages = list(stream)
    assert "".join(m.reasoning_text for m in messages) == whole.reasoning_text
    assert "".join(m.text for m in messages) == whole.text
    assert [t for m in messages for t in m.token_ids] == list(whole.token_ids)


def test_streamed_chat_with_tools_equals_plain(client: openai.OpenAI) -> None:
    plain = chat(client, tools=[TOOL], max_tokens=24).choices[0]
    chunks = list(chat(client, tools=[TOOL], max_tokens=24, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == (plain.message.content or "")
    assert [t for d in deltas for t in d.tool_calls or []] == []  # the model made no call
    assert chunks[-1].choices[0].finish_reason == plain.finish_reason


def test_bad_tools_are_400_naming_the_parameter(
    pipeline: Deployment, client: openai.OpenAI
) -> None:
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, tools=[bad_schema])
    assert bad.value.param == "tools[0].function.parameters"
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert bad.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, tools=[TOOL], tool_choice="required", extra_body={"guided_json": WEATHER})
    assert bad.value.param == "tool_choice"
    with pytest.raises(grpc.RpcError) as failed:
        grpc_complete(pipeline, tools=[chat_pb2.Tool(name="f", parameters="[1]")])
    assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    violations = bad_request_of(failed.value).field_violations
    assert [v.field for v in violations] == ["tools[0].parameters"]


def test_an_enforced_tool_that_does_not_compile_is_named(
    pipeline: Deployment, client: openai.OpenAI
) -> None:
    """Under tool_choice required or a named function, a tool's parameters that llguidance
    cannot enforce (a keyword it lacks, nesting past the limit) are the tool's error: they
    were the tool-call grammar's (`sampling.grammar`, a field the caller never sent; nesting
    RESOURCE_EXHAUSTED). Under auto nothing is enforced, and the same tools are taken."""
    unique = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(80):
        deep = {"type": "object", "properties": {"a": deep}}
    tools = [TOOL] + [
        {"type": "function", "function": {"name": f"f{i}", "parameters": p}}
        for i, p in enumerate((unique, deep))
    ]
    for i, words in ((1, "unsupported JSON Schema keywords: uniqueItems"), (2, "nested deeper")):
        name = tools[i]["function"]["name"]
        for choice in ("required", {"type": "function", "function": {"name": name}}):
            with pytest.raises(openai.BadRequestError) as bad:
                chat(client, tools=[tools[0], tools[i]], tool_choice=choice, max_tokens=4)
            assert bad.value.param == "tools[1].function.parameters", bad.value.message
            assert words in bad.value.message
        with pytest.raises(grpc.RpcError) as failed:
            grpc_complete(
                pipeline,
                tools=[
                    chat_pb2.Tool(
                        name=name, parameters=json.dumps(tools[i]["function"]["parameters"])
                    )
                ],
                tool_choice=generation_pb2.ToolChoice(
                    mode=generation_pb2.TOOL_CHOICE_MODE_REQUIRED
                ),
            )
        assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT, failed.value.details()
        violations = bad_request_of(failed.value).field_violations
        assert [v.field for v in violations] == ["tools[0].parameters"]
        assert chat(client, tools=[tools[0], tools[i]], max_tokens=4).choices  # auto: taken


# ---- after constrained decoding is wired in ---------------------------------------------------


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_forced_tool_choice_always_gives_a_valid_call(
    pipeline: Deployment, client: openai.OpenAI, tool_choice: str
) -> None:
    choice: Any = tool_choice
    if tool_choice == "named":
        choice = {"type": "function", "function": {"name": "get_weather"}}
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    for call in forced_calls(client, TOOL, choice, num_seeds=6):
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    streamed = list(
        chat(
            client, tools=[TOOL], tool_choice=choice, max_tokens=200, extra_body=extra, stream=True
        )
    )
    calls = [t for c in streamed if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert calls and calls[0].function.name == "get_weather"
    whole = grpc_complete(
        pipeline,
        tools=[GRPC_TOOL],
        enable_thinking=False,
        tool_choice=generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_REQUIRED),
        sampling=sampling_pb2.SamplingParams(max_tokens=200, temperature=0),
    )
    assert whole.tool_calls and whole.text == "" and whole.finish_reason == 1  # STOP
    jsonschema.validate(json.loads(whole.tool_calls[0].arguments), WEATHER)


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_a_response_format_beside_a_forced_tool_choice_still_gives_calls(
    client: openai.OpenAI, tool_choice: str
) -> None:
    """openai-agents sends an agent's output type as response_format with every turn, its
    forced tool calls (ModelSettings tool_choice "required") included; OpenAI and vLLM answer
    that turn with calls (the format shapes content, and there is none). This body is the one
    openai-agents 0.20 sent; a bad response_format is still a 400 naming it."""
    choice: Any = tool_choice
    if tool_choice == "named":
        choice = {"type": "function", "function": {"name": "get_weather"}}
    answer = {
        "type": "object",
        "properties": {
            "city": {"maxLength": 8, "title": "City", "type": "string"},
            "temp": {"maximum": 50, "minimum": -50, "title": "Temp", "type": "integer"},
        },
        "required": ["city", "temp"],
        "title": "Answer",
        "additionalProperties": False,
    }
    output_type = {
        "type": "json_schema",
        "json_schema": {"name": "final_output", "strict": True, "schema": answer},
    }
    tool = {"type": "function", "function": {**TOOL["function"], "strict": True}}
    args: dict[str, Any] = {
        "messages": [{"content": "use tools", "role": "system"}, *ASK],
        "tools": [tool],
        "tool_choice": choice,
        "response_format": output_type,
        "max_tokens": 200,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    }
    (whole,) = chat(client, **args).choices
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(chat(client, stream=True, **args))
    streamed = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [t.function.arguments for t in streamed] == [call.function.arguments]
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, **{**args, "response_format": {"type": "json_schema", "json_schema": {}}})
    assert bad.value.param == "response_format.json_schema.schema"


def test_parameters_without_a_type_still_give_calls(client: openai.OpenAI) -> None:
    """A tool whose parameters name no type (an object, as OpenAI reads them): the forced
    answer is still a call (the schema was enforced as sent, any JSON value as arguments, and
    `"arguments": true` came back as text with finish stop)."""
    untyped = {"properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": untyped}}
    for call in forced_calls(client, tool, "required", num_seeds=4):
        jsonschema.validate(json.loads(call.function.arguments), {"type": "object", **untyped})


def test_response_format_json_schema_is_valid_json(client: openai.OpenAI) -> None:
    schema = {"name": "weather", "schema": WEATHER, "strict": True}
    for seed in range(4):
        reply = chat(
            client, temperature=1.0, seed=seed, max_tokens=200,
            response_format={"type": "json_schema", "json_schema": schema},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )  # fmt: skip
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content or ""), WEATHER)


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_a_forced_call_cut_by_max_tokens_is_dropped_on_both_apis(
    pipeline: Deployment, client: openai.OpenAI, tool_choice: str
) -> None:
    """max_tokens ends a forced answer inside its call: finish reason length, no call and no
    content (the half block came back as content, '<tool_call>' and all), whole, streamed
    and on gRPC alike."""
    choice: Any = tool_choice
    grpc_choice = generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_REQUIRED)
    if tool_choice == "named":
        choice = {"type": "function", "function": {"name": "get_weather"}}
        grpc_choice = generation_pb2.ToolChoice(
            mode=generation_pb2.TOOL_CHOICE_MODE_FUNCTION, function_name="get_weather"
        )
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    args: dict[str, Any] = {"tools": [TOOL], "tool_choice": choice, "max_tokens": 8}
    (whole,) = chat(client, extra_body=extra, **args).choices
    assert whole.finish_reason == "length"
    assert whole.message.content is None and not whole.message.tool_calls
    chunks = list(chat(client, extra_body=extra, stream=True, **args))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert not "".join(d.delta.content or "" for d in deltas)
    assert not [t for d in deltas for t in d.delta.tool_calls or []]
    assert deltas[-1].finish_reason == "length"
    reply = grpc_complete(
        pipeline, max_tokens=8, tools=[GRPC_TOOL], enable_thinking=False, tool_choice=grpc_choice
    )
    assert reply.text == "" and not reply.tool_calls
    assert reply.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
