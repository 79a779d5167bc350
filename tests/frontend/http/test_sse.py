"""sse.serve on a real aiohttp server: an error before the first delta is an HTTP error with its
status, one after it an error event followed by [DONE], each byte as framed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, Counter

from mili.engine.stop import FinishReason
from mili.errors import InvalidArgument, ResourceExhausted, Unavailable
from mili.telemetry.metrics import FrontendMetrics
from services.frontend.http_api import sse
from services.frontend.http_api.choices import Choice
from services.frontend.http_api.completions import CompletionJson
from services.frontend.http_api.openai_call import Head
from services.frontend.http_api.openai_request import OpenAIRequest
from services.frontend.http_api.telemetry import add_telemetry
from services.frontend.pipeline import Delta
from services.frontend.validation import Limits, RequestInput, validate

HEAD = Head("r1", 1700000000, "m")


async def failing_after(num_deltas: int, error: Exception) -> AsyncGenerator[tuple[int, Delta]]:
    for i in range(num_deltas):
        yield 0, Delta([i], f"t{i}")
    raise error


async def finishing() -> AsyncGenerator[tuple[int, Delta]]:
    yield 0, Delta([1], "a")
    yield 0, Delta([2], "b", [], FinishReason.LENGTH, num_prompt_tokens=3, num_completion_tokens=2)


def served(
    events: AsyncGenerator[tuple[int, Delta]],
    *,
    include_usage: bool = False,
    metrics: FrontendMetrics | None = None,
) -> bytes:
    """The raw reply (status line aside) of sse.serve over `events`; `metrics`: the frontend's
    HTTP telemetry around it."""
    valid = validate(RequestInput(prompt="x"), Limits())
    request = OpenAIRequest(
        model=None, inputs=(RequestInput(prompt="x"),), is_stream=True, include_usage=include_usage
    )
    chunks = CompletionJson(request, [Choice(0, 0, valid)], HEAD, [], None)
    generated = Counter("generated", "tokens", registry=CollectorRegistry())

    async def handler(http_request: web.Request) -> web.StreamResponse:
        return await sse.serve(
            http_request, events, chunks, lambda f: f.removeprefix("sampling."), generated
        )

    async def main() -> bytes:
        app = web.Application()
        if metrics is not None:
            add_telemetry(app, metrics)
        app.router.add_post("/", handler)
        async with TestClient(TestServer(app)) as client:
            response = await client.post("/")
            body = await response.read()
            return f"{response.status} {response.content_type}\n".encode() + body

    return asyncio.run(main())


def test_an_error_before_the_first_delta_is_an_http_error() -> None:
    reply = served(failing_after(0, InvalidArgument("sampling.top_p", 5, "must be <= 1")))
    head, body = reply.split(b"\n", 1)
    assert head == b"400 application/json"
    assert json.loads(body)["error"]["param"] == "top_p"
    head, body = served(failing_after(0, ResourceExhausted("full", 2.0))).split(b"\n", 1)
    assert head == b"429 application/json"


def test_an_error_after_the_first_delta_is_an_event_then_done() -> None:
    reply = served(failing_after(1, ResourceExhausted("decode went away", 1.0)))
    head, body = reply.split(b"\n", 1)
    assert head == b"200 text/event-stream"
    first, error, done, rest = body.split(b"\n\n")
    assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == "t0"
    assert error.startswith(b"data: {")
    assert json.loads(error.removeprefix(b"data: "))["error"]["type"] == "rate_limit_error"
    assert (done, rest) == (b"data: [DONE]", b"")


def test_a_finished_stream_with_usage() -> None:
    head, body = served(finishing(), include_usage=True).split(b"\n", 1)
    assert head == b"200 text/event-stream"
    *chunks, done, rest = body.split(b"\n\n")
    assert (done, rest) == (b"data: [DONE]", b"")
    parsed = [json.loads(c.removeprefix(b"data: ")) for c in chunks]
    assert [c["choices"][0]["text"] for c in parsed[:-1]] == ["a", "b"]
    assert parsed[-2]["choices"][0]["finish_reason"] == "length"
    assert parsed[-1]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_a_stream_ended_by_an_error_counts_under_its_status() -> None:
    """Its 200 went out first; the series count the error's status (a decode dying mid-stream
    is an HTTP error in the error rate, as it is UNAVAILABLE on gRPC)."""
    metrics = FrontendMetrics(CollectorRegistry())
    served(failing_after(1, Unavailable("decode went away")), metrics=metrics)
    count = metrics.registry.get_sample_value
    labels = {"route": "/", "method": "POST"}
    assert count("mili_http_requests_total", {**labels, "status": "503"}) == 1
    assert count("mili_http_requests_total", {**labels, "status": "200"}) is None
    served(finishing(), metrics=metrics)
    assert count("mili_http_requests_total", {**labels, "status": "200"}) == 1
