"""POST /tokenize and /detokenize (vLLM's) against the real services on the demo model: the
ids are the tokenizer's (HF `tokenizers` on the same file is the oracle), a chat's count is
the prompt_tokens a chat completion of the same messages reports, the text round-trips, and bad
input is a 400 naming the parameter."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from mili.pb.frontend.v1 import generation_pb2
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


def test_another_model_is_404(pipeline: Deployment) -> None:
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        status, reply = post(pipeline, path, {**body, "model": "not-served"})
        assert status == 404 and reply["error"]["code"] == "model_not_found", reply
