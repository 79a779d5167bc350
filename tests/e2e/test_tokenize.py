"""Tokenizing without generating, on both APIs, against the real services on the demo model:
HTTP POST /tokenize and /detokenize (vLLM's), POST /v1/responses/input_tokens (OpenAI's) and
gRPC GenerationService.Tokenize. The ids are the
tokenizer's (HF `tokenizers` on the same file is the oracle), a chat's count is the
prompt_tokens a generation of the same messages reports, the text round-trips, and bad input is
a 400 / INVALID_ARGUMENT naming the parameter."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from tokenizers import Tokenizer

from mili.pb.common.v1 import chat_pb2, sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from mili.rpc.status import bad_request_of
from tests.e2e.conftest import Deployment

pytestmark = pytest.mark.slow

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def post(deployment: Deployment, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        deployment.frontend.http_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def hf(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))


def test_a_prompt_is_the_tokenizers_ids_and_they_round_trip(
    pipeline: Deployment, hf: Tokenizer
) -> None:
    text = "Hello world, <|im_end|> and ünïcödé"
    status, reply = post(pipeline, "/tokenize", {"prompt": text})
    assert status == 200, reply
    assert reply["tokens"] == hf.encode(text, add_special_tokens=False).ids
    assert reply["count"] == len(reply["tokens"]) and reply["token_strs"] is None
    info = pipeline.stub().Info(generation_pb2.InfoRequest(), timeout=5)
    assert reply["max_model_len"] == info.max_context_tokens
    status, back = post(pipeline, "/detokenize", {"tokens": reply["tokens"]})
    assert (status, back) == (200, {"prompt": text})
    assert back["prompt"] == hf.decode(reply["tokens"], skip_special_tokens=False)


def test_messages_count_as_a_chat_completion_counts_its_prompt(pipeline: Deployment) -> None:
    for extra in ({}, {"tools": [TOOL]}, {"chat_template_kwargs": {"enable_thinking": False}}):
        chat: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], **extra}
        status, reply = post(pipeline, "/tokenize", chat)
        assert status == 200, reply
        status, done = post(pipeline, "/v1/chat/completions", {**chat, "max_tokens": 1})
        assert status == 200, done
        assert reply["count"] == done["usage"]["prompt_tokens"], extra


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "a", "return_token_strs": True}, "return_token_strs"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "messages"),
        ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
        ("/tokenize", {"prompt": [1, 10**6]}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens[1]"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_parameter(
    pipeline: Deployment, path: str, body: dict[str, Any], param: str
) -> None:
    status, reply = post(pipeline, path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply


def test_responses_input_tokens_count_what_the_response_reports(pipeline: Deployment) -> None:
    """OpenAI's input token count, as the openai SDK asks it (and LiteLLM's token counting asks
    an `openai/` deployment): the input_tokens a Responses request of the same body reports.
    Its path is not a stored response's id."""
    client = openai.OpenAI(base_url=pipeline.frontend.http_url + "/v1", api_key="unused")
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    asks: list[dict[str, Any]] = [
        {"input": "Hi"},
        {"input": [{"role": "user", "content": "Hi"}], "instructions": "Be brief."},
        {"input": "Weather?", "tools": [tool], "reasoning": {"effort": "none"}},
    ]
    for ask in asks:
        counted = client.responses.input_tokens.count(**ask)
        assert counted.object == "response.input_tokens"
        done = client.responses.create(**ask, max_output_tokens=1)
        assert done.usage is not None
        assert counted.input_tokens == done.usage.input_tokens, ask
    status, reply = post(pipeline, "/v1/responses/input_tokens", {"input": []})
    assert status == 400 and reply["error"]["param"] == "input", reply


def test_another_model_is_404(pipeline: Deployment) -> None:
    for path, body in (
        ("/tokenize", {"prompt": "a"}),
        ("/detokenize", {"tokens": [1]}),
        ("/v1/responses/input_tokens", {"input": "a"}),
    ):
        status, reply = post(pipeline, path, {**body, "model": "not-served"})
        assert status == 404 and reply["error"]["code"] == "model_not_found", reply


def test_grpc_tokenize_counts_as_a_generation_counts_its_prompt(
    pipeline: Deployment, hf: Tokenizer
) -> None:
    stub = pipeline.stub()
    text = "Hello world"
    plain = stub.Tokenize(generation_pb2.TokenizeRequest(prompt=text), timeout=30)
    assert list(plain.token_ids) == hf.encode(text, add_special_tokens=False).ids
    info = stub.Info(generation_pb2.InfoRequest(), timeout=5)
    assert plain.max_context_tokens == info.max_context_tokens and plain.request_id
    _, http = post(pipeline, "/tokenize", {"prompt": text})
    assert http["tokens"] == list(plain.token_ids)  # one tokenization behind both APIs
    messages = [chat_pb2.ChatMessage(role="user", content="Weather in Paris?")]
    tool = chat_pb2.Tool(name="get_weather", parameters='{"type": "object"}')
    for fields in ({}, {"tools": [tool]}, {"enable_thinking": False}):
        asked = generation_pb2.TokenizeRequest(request_id="tok-1", messages=messages, **fields)
        chat = stub.Tokenize(asked, timeout=30)
        assert chat.request_id == "tok-1"
        sampling = sampling_pb2.SamplingParams(max_tokens=1)
        done = stub.Complete(
            generation_pb2.CompleteRequest(messages=messages, sampling=sampling, **fields),
            timeout=60,
        )
        assert len(chat.token_ids) == done.usage.prompt_tokens, fields


def test_grpc_tokenize_refuses_bad_input_naming_the_field(pipeline: Deployment) -> None:
    stub = pipeline.stub()
    bad_tool = chat_pb2.Tool(name="get_weather", parameters="[1]")
    message = chat_pb2.ChatMessage(role="user", content="x")
    with_bad_tool = generation_pb2.TokenizeRequest(messages=[message], tools=[bad_tool])
    for request, field in [
        (generation_pb2.TokenizeRequest(), "prompt"),
        (with_bad_tool, "tools[0].parameters"),
    ]:
        with pytest.raises(grpc.RpcError) as caught:
            stub.Tokenize(request, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        fields = [v.field for v in bad_request_of(caught.value).field_violations]
        assert field in fields, fields
