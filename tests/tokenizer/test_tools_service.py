"""Tools through the tokenizer service over real gRPC: the proto fields reach the template, ids
equal HF's apply_chat_template(messages, tools=...), and bad tools name their field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mili.pb.common.v1 import chat_pb2
from mili.pb.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tests.service_process import ServiceProcess
from tests.tokenizer.test_tokenizer_service import _invalid

SCHEMA = (
    '{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}'
)
TOOLS = [
    chat_pb2.Tool(name="get_weather", description="Weather in a city.", parameters=SCHEMA),
    chat_pb2.Tool(name="get_time"),
]
CALL = chat_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city":"Paris","days":2}')
MESSAGES = [
    chat_pb2.ChatMessage(role="system", content="Be brief."),
    chat_pb2.ChatMessage(role="user", content="Paris?"),
    chat_pb2.ChatMessage(
        role="assistant", content="", reasoning_content="Use the tool.", tool_calls=[CALL, CALL]
    ),
    chat_pb2.ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="call_1"),
    chat_pb2.ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="call_1"),
]
# What an HF caller passes for the same conversation (OpenAI-style; arguments as objects).
HF_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": json.loads(SCHEMA),
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
HF_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
}
HF_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Use the tool.",
        "tool_calls": [HF_CALL, HF_CALL],
    },
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
]


@pytest.fixture(scope="module")
def stub(tokenizer_service: ServiceProcess) -> Iterator[tokenizer_pb2_grpc.TokenizerServiceStub]:
    with grpc.insecure_channel(tokenizer_service.address) as channel:
        yield tokenizer_pb2_grpc.TokenizerServiceStub(channel)


@pytest.mark.parametrize("thinking", [None, False], ids=str)
def test_tools_and_calls_equal_hf(stub, demo_model_dir: Path, thinking: bool | None) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(demo_model_dir)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    expected = hf.apply_chat_template(
        HF_MESSAGES, tools=HF_TOOLS, add_generation_prompt=True, tokenize=True, **kwargs
    )
    response = stub.Tokenize(
        tokenizer_pb2.TokenizeRequest(messages=MESSAGES, tools=TOOLS, enable_thinking=thinking)
    )
    assert list(response.token_ids) == list(expected["input_ids"])
    assert "# Tools" in response.prompt
    # Arguments are rendered as Qwen3 writes them, whatever the caller's spacing.
    assert '"arguments": {"city": "Paris", "days": 2}}' in response.prompt


@pytest.mark.parametrize(
    ("tools", "messages", "field"),
    [
        ([chat_pb2.Tool(description="nameless")], MESSAGES[:2], "tools[0].name"),
        ([TOOLS[0], chat_pb2.Tool(name="f", parameters="{")], MESSAGES[:2], "tools[1].parameters"),
        ([chat_pb2.Tool(name="f", parameters="[]")], MESSAGES[:2], "tools[0].parameters"),
        (
            [],
            [
                *MESSAGES[:2],
                chat_pb2.ChatMessage(
                    role="assistant", tool_calls=[CALL, chat_pb2.ToolCall(name="f", arguments="1")]
                ),
            ],
            "messages[2].tool_calls[1].arguments",
        ),
    ],
)
def test_bad_tools_are_invalid_argument_naming_the_field(
    stub, tools: list, messages: list, field: str
) -> None:
    found, _ = _invalid(
        stub.Tokenize, tokenizer_pb2.TokenizeRequest(messages=messages, tools=tools)
    )
    assert found == field


def test_tools_without_messages(stub) -> None:
    found, description = _invalid(
        stub.Tokenize, tokenizer_pb2.TokenizeRequest(text="hi", tools=TOOLS)
    )
    # `text` with tools: tools need a chat.
    assert found == "tools" and "messages" in description


def test_tools_count_toward_the_character_limit(stub) -> None:
    big = chat_pb2.Tool(name="f", description="x" * 4990)  # the service allows 5000 characters
    found, _ = _invalid(
        stub.Tokenize, tokenizer_pb2.TokenizeRequest(messages=MESSAGES[:2], tools=[big])
    )
    assert found == "tools"
