"""Bad input on the HTTP API, as clients get it wrong: 400 bodies of seeded random mutations of
valid requests (a value swapped for one of another type or out of range, a key dropped or
added, the JSON cut short or a byte changed) against a real frontend, tokenizer, prefill and
decode on the demo model. No request may get a 5xx or a body that is not the OpenAI error
shape, and after all of them the deployment still answers and every KV block is free."""

from __future__ import annotations

import copy
import http.client
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

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
