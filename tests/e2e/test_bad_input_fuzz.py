"""Bad input, as clients get it wrong, against a real frontend, tokenizer, prefill and decode on
the demo model: seeded random mutations of valid requests, NUM_REQUESTS on each API.

- HTTP: a value swapped for one of another type or out of range, a key dropped or added, the
  JSON cut short or a byte changed. None may get a 5xx or a body that is not the OpenAI error
  shape.
- gRPC: a field set to an extreme of its type (NaN and infinities, the ends of its integer
  range, an enum number no one defined, an empty or huge string, a JSON schema that refers to
  itself), a list cleared or made long, a message cleared. Each answer is OK or a status that
  names the caller's error (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...), never UNKNOWN,
  INTERNAL or UNAVAILABLE.

After each, the deployment still answers and every KV block is free."""

from __future__ import annotations

import copy
import http.client
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from mili.pb.common.v1 import chat_pb2, sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from tests.e2e.conftest import Deployment, deploy
from tests.service_process import ServiceProcess

pytestmark = pytest.mark.slow

NUM_REQUESTS = 400
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["city"],
}
TOOL = {
    "type": "function",
    "function": {"name": "weather", "description": "the weather", "parameters": SCHEMA},
}
# Valid requests of each endpoint, with the features that parse the most (each given the
# served model's name).
BASES: list[tuple[str, dict[str, Any]]] = [
    (
        "/v1/completions",
        {
            "prompt": ["Hello", "Hi there"],
            "max_tokens": 3,
            "temperature": 0.7,
            "top_p": 0.9,
            "n": 2,
            "seed": 1,
            "logprobs": 2,
            "stop": ["\n"],
            "logit_bias": {"5": 1.0},
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call-1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call-1", "content": "sunny"},
            ],
            "tools": [TOOL],
            "tool_choice": "auto",
            "max_completion_tokens": 4,
            "logprobs": True,
            "top_logprobs": 2,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "A city?"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
            },
            "max_tokens": 4,
            "stream": True,
        },
    ),
    (
        "/v1/responses",
        {
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
            "instructions": "Be brief.",
            "max_output_tokens": 4,
            "tools": [{"type": "function", "name": "weather", "parameters": SCHEMA}],
            "text": {"format": {"type": "text"}},
            "store": False,
        },
    ),
    ("/tokenize", {"prompt": "Hello there", "add_special_tokens": True}),
    ("/detokenize", {"tokens": [9, 10, 11]}),
]
# What a careless client puts where something else belongs.
ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1.5, -1e308, 2**63, 10**30, "", "x", "\ud800", "é" * 3000,
    [], [None], [[[]]], {}, {"a": 1}, {"type": "nope"}, [1, "a"], float("nan"),
]  # fmt: skip


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key and index path inside `value`."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield (*prefix, key)
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield (*prefix, i)
            yield from _paths(item, (*prefix, i))


def _mutated(rng: random.Random, body: dict[str, Any]) -> bytes:
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        paths = list(_paths(body))
        if not paths:  # every key dropped
            break
        path = rng.choice(paths)
        *head, last = path
        parent: Any = body
        for step in head:
            parent = parent[step]
        kind = rng.random()
        if kind < 0.6:
            parent[last] = copy.deepcopy(rng.choice(ODD_VALUES))
        elif kind < 0.8 and isinstance(parent, dict):
            del parent[last]
        elif isinstance(parent, dict):
            parent[f"unknown_{rng.randint(0, 9)}"] = copy.deepcopy(rng.choice(ODD_VALUES))
    raw = json.dumps(body).encode()  # NaN goes out as the bare token NaN, as Python writes it
    cut = rng.random()
    if cut < 0.05:
        raw = raw[: rng.randrange(len(raw))]
    elif cut < 0.1:
        i = rng.randrange(len(raw))
        raw = raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1 :]
    return raw


def _post(url: str, path: str, raw: bytes) -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("POST", path, raw, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def deployment(demo_model_dir: Path, e2e_tokenizer: ServiceProcess) -> Iterator[Deployment]:
    # Short generations whatever a mutation asks: a larger max_tokens is a 400.
    d = deploy(
        demo_model_dir,
        e2e_tokenizer,
        frontend_args=("--http-port", "0", "--max-tokens-limit", "8"),
    )
    yield d
    d.stop()


def test_mutated_requests_get_4xx_errors_and_leave_the_deployment_whole(
    deployment: Deployment,
) -> None:
    url = deployment.frontend.http_url
    free = deployment.settled_free_blocks()
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("GET", "/v1/models")
    model = json.loads(conn.getresponse().read())["data"][0]["id"]
    conn.close()
    bases = [(path, {"model": model, **body}) for path, body in BASES]
    for path, body in bases:  # the bases themselves are valid
        status, data = _post(url, path, json.dumps(body).encode())
        assert status == 200, (path, data[:500])
    rng = random.Random(0)
    statuses: dict[int, int] = {}
    for _ in range(NUM_REQUESTS):
        path, body = rng.choice(bases)
        raw = _mutated(rng, body)
        status, data = _post(url, path, raw)
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (path, raw[:800], data[:800])
        if status >= 400:
            error = json.loads(data)["error"]
            assert error["message"] and error["type"], (path, raw[:800], data[:800])
    assert statuses.get(400, 0) > NUM_REQUESTS // 4, statuses  # most mutations are refused
    assert statuses.get(200, 0) > 0, statuses  # some are still valid
    for path, body in bases:  # still serving
        status, data = _post(url, path, json.dumps(body).encode())
        assert status == 200, (path, data[:500])
    assert deployment.settled_free_blocks() == free


# gRPC ----------------------------------------------------------------------------------------

GRPC_BASES: list[Message] = [
    generation_pb2.CompleteRequest(
        prompt="Hello",
        sampling=sampling_pb2.SamplingParams(
            max_tokens=3,
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            seed=1,
            stop=["\n"],
            stop_token_ids=[5],
            logprobs=2,
            logit_bias={5: 1.0},
            json_schema=json.dumps(SCHEMA),
        ),
        priority=1,
    ),
    generation_pb2.CompleteRequest(
        messages=[
            chat_pb2.ChatMessage(role="user", content="Weather?"),
            chat_pb2.ChatMessage(
                role="assistant",
                tool_calls=[chat_pb2.ToolCall(id="c1", name="weather", arguments='{"city": "x"}')],
            ),
            chat_pb2.ChatMessage(role="tool", content="sunny", tool_call_id="c1"),
        ],
        tools=[chat_pb2.Tool(name="weather", description="w", parameters=json.dumps(SCHEMA))],
        tool_choice=generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_REQUIRED),
        sampling=sampling_pb2.SamplingParams(max_tokens=4, prompt_logprobs=1),
        enable_thinking=False,
    ),
    generation_pb2.CompleteRequest(
        token_ids=[9, 10, 11],
        sampling=sampling_pb2.SamplingParams(
            max_tokens=2,
            choice=sampling_pb2.ChoiceConstraint(choices=["yes", "no"]),
            repetition_penalty=1.1,
        ),
    ),
]
_INTS = {
    FieldDescriptor.TYPE_INT32: [-(2**31), -1, 0, 2**31 - 1],
    FieldDescriptor.TYPE_UINT32: [0, 1, 2**32 - 1],
    FieldDescriptor.TYPE_INT64: [-(2**63), -1, 2**63 - 1],
    FieldDescriptor.TYPE_UINT64: [0, 2**64 - 1],
}
_FLOATS = [float("nan"), float("inf"), float("-inf"), -0.0, -5.0, 1e30, 1e-30]
_STRINGS = [
    "", "x", "\x00", "é" * 3000, "{", "[" * 2000,
    '{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}',
    '{"type": "string", "pattern": "(a+)+$", "minLength": 100000}',
]  # fmt: skip
OK_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.NOT_FOUND,
}


def _fields(message: Message) -> Iterator[tuple[Message, FieldDescriptor]]:
    """Every field of `message` and of the messages set inside it."""
    for field in message.DESCRIPTOR.fields:
        yield message, field
        if field.type != FieldDescriptor.TYPE_MESSAGE or field.message_type.GetOptions().map_entry:
            continue
        if field.is_repeated:
            for item in getattr(message, field.name):
                yield from _fields(item)
        elif message.HasField(field.name):
            yield from _fields(getattr(message, field.name))


def _odd_value(rng: random.Random, field: FieldDescriptor) -> Any:
    if field.type in _INTS:
        return rng.choice(_INTS[field.type])
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return rng.choice(_FLOATS)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if field.type == FieldDescriptor.TYPE_ENUM:
        return rng.choice([0, 1, 3, 99])
    return rng.choice(_STRINGS)


def _mutate(rng: random.Random, message: Message) -> None:
    for _ in range(rng.randint(1, 3)):
        parent, field = rng.choice(list(_fields(message)))
        value = getattr(parent, field.name)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:  # logit_bias: an id and a bias
                value[rng.choice(_INTS[FieldDescriptor.TYPE_UINT32])] = rng.choice(_FLOATS)
            elif field.is_repeated and len(value) and rng.random() < 0.5:
                for _ in range(rng.choice([1, 300])):
                    value.add().CopyFrom(value[0])
            else:
                parent.ClearField(field.name)
        elif field.is_repeated:
            del value[:]
            if rng.random() < 0.7:
                value.extend([_odd_value(rng, field)] * rng.choice([1, 3, 5000]))
        else:
            setattr(parent, field.name, _odd_value(rng, field))


def test_mutated_grpc_requests_get_statuses_that_name_the_callers_error(
    deployment: Deployment,
) -> None:
    stub = deployment.stub()
    free = deployment.settled_free_blocks()
    for base in GRPC_BASES:  # the bases themselves are valid
        stub.Complete(base, timeout=60)
    rng = random.Random(0)
    codes: dict[str, int] = {}
    for i in range(NUM_REQUESTS):
        request = generation_pb2.CompleteRequest()
        request.CopyFrom(rng.choice(GRPC_BASES))
        _mutate(rng, request)
        try:
            if i % 4:
                stub.Complete(request, timeout=60)
            else:  # the streaming call: its own path to the same validation
                streamed = generation_pb2.GenerateRequest.FromString(request.SerializeToString())
                list(stub.Generate(streamed, timeout=60))
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
            assert code in OK_CODES, (request, e.details())
            assert e.details(), request
        codes[code.name] = codes.get(code.name, 0) + 1
    assert codes.get("INVALID_ARGUMENT", 0) > NUM_REQUESTS // 4, codes
    assert codes.get("OK", 0) > 0, codes
    for base in GRPC_BASES:  # still serving
        stub.Complete(base, timeout=60)
    assert deployment.settled_free_blocks() == free
