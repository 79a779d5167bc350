"""The HTTP port's telemetry middleware on a real aiohttp server (127.0.0.1, port 0): one SERVER
span per request (child of the caller's traceparent, current in the handler, ended with a
stream's last byte), bounded Prometheus labels, X-Request-Id echoed, one WARNING per 5xx.

Spans go to a provider of the test's own (an in-memory exporter), not the global one; the
frontend end to end, with the global provider and a real OTLP receiver, is tests/e2e/
test_http_ops.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from mili.telemetry.metrics import FrontendMetrics
from services.frontend.http_api.errors import openai_errors
from services.frontend.http_api.server import HttpConfig, HttpServer
from services.frontend.http_api.telemetry import add_telemetry, request_id_of

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


class Harness:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = provider.get_tracer("test")
        self.metrics = FrontendMetrics(CollectorRegistry())
        self.seen: dict[str, Any] = {}  # what handlers saw
        self.last_write_ns = 0
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application(middlewares=[openai_errors])
        add_telemetry(app, self.metrics, self.tracer)
        app.router.add_get("/items/{item_id}", self.item)
        app.router.add_get("/boom", self.boom)
        app.router.add_get("/stream", self.stream)
        app.router.add_get("/hold", self.hold)
        app.router.add_get("/broken", self.broken)
        return app

    async def item(self, request: web.Request) -> web.Response:
        self.seen["current"] = trace.get_current_span()
        self.seen["request_id"] = request_id_of(request)
        with self.tracer.start_as_current_span("generate demo"):  # as Generations' observer
            pass
        return web.json_response({"id": request.match_info["item_id"]})

    async def boom(self, request: web.Request) -> web.Response:
        raise RuntimeError("kaput")

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for chunk in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
            await asyncio.sleep(0.05)
            await response.write(chunk)
        await response.write_eof()
        self.last_write_ns = time.time_ns()
        return response

    async def broken(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        raise RuntimeError("mid-stream")

    async def hold(self, request: web.Request) -> web.Response:
        self.seen["held"] = True
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def count(self, route: str, method: str, status: str) -> float | None:
        return self.metrics.registry.get_sample_value(
            "mili_http_requests_total", {"route": route, "method": method, "status": status}
        )

    def num_observed(self, route: str) -> float | None:
        return self.metrics.registry.get_sample_value(
            "mili_http_request_duration_seconds_count", {"route": route}
        )


@contextlib.asynccontextmanager
async def serving(h: Harness) -> AsyncIterator[aiohttp.ClientSession]:
    server = HttpServer(h.app(), HttpConfig(port=0, drain_timeout_s=1.0))
    await server.start()
    h.url = server.url
    try:
        async with aiohttp.ClientSession() as session:
            yield session
    finally:
        await server.drain()


def run(test: Callable[[Harness, aiohttp.ClientSession], Awaitable[None]]) -> Harness:
    h = Harness()

    async def main() -> None:
        async with serving(h) as session:
            await test(h, session)

    asyncio.run(main())
    return h


def test_a_request_is_one_server_span_under_the_callers_traceparent_current_in_the_handler() -> (
    None
):
    async def test(h: Harness, session: aiohttp.ClientSession) -> None:
        headers = {"traceparent": TRACEPARENT, "X-Request-Id": "mine-1", "User-Agent": "ua/1"}
        async with session.get(f"{h.url}/items/42", headers=headers) as response:
            assert response.status == 200
            assert response.headers["X-Request-Id"] == "mine-1"

    h = run(test)
    assert h.seen["request_id"] == "mine-1"
    (child, server) = sorted(h.spans(), key=lambda s: s.kind != SpanKind.INTERNAL)
    assert server.name == "GET /items/{item_id}" and server.kind is SpanKind.SERVER
    assert h.seen["current"] is not None
    assert h.seen["current"].get_span_context() == server.context  # current in the handler
    assert child.parent is not None and child.parent.span_id == server.context.span_id
    assert server.parent is not None and server.parent.is_remote
    assert f"{server.context.trace_id:032x}" == TRACE_ID
    assert f"{server.parent.span_id:016x}" == PARENT_ID
    attributes = dict(server.attributes or {})
    port = int(h.url.rsplit(":", 1)[1])
    assert attributes == {
        "http.request.method": "GET",
        "http.route": "/items/{item_id}",
        "url.path": "/items/42",
        "url.scheme": "http",
        "network.protocol.version": "1.1",
        "server.address": "127.0.0.1",
        "server.port": port,
        "client.address": "127.0.0.1",
        "user_agent.original": "ua/1",
        "http.response.status_code": 200,
    }
    assert server.status.status_code is StatusCode.UNSET


def test_a_streams_span_and_duration_end_with_its_last_byte_and_it_echoes_a_fresh_id() -> None:
    async def test(h: Harness, session: aiohttp.ClientSession) -> None:
        async with session.get(f"{h.url}/stream") as response:
            assert await response.read() == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
            h.seen["header"] = response.headers["X-Request-Id"]

    h = run(test)
    assert re.fullmatch(r"[0-9a-f]{32}", h.seen["header"])  # none sent: a fresh one
    (span,) = h.spans()
    assert span.name == "GET /stream" and span.parent is None  # no traceparent: a new trace
    assert span.end_time is not None and span.start_time is not None
    assert span.end_time >= h.last_write_ns
    assert span.end_time - span.start_time >= 150_000_000  # three 50 ms chunks
    assert h.num_observed("/stream") == 1


def test_labels_are_route_templates_and_known_methods_whatever_the_client_sends() -> None:
    async def test(h: Harness, session: aiohttp.ClientSession) -> None:
        for path in ("/items/1", "/items/2", "/nope/a", "/nope/b"):
            async with session.get(f"{h.url}{path}") as response:
                assert response.headers["X-Request-Id"]  # errors echo it too
        async with session.post(f"{h.url}/items/1") as response:
            assert response.status == 405
        async with session.request("PROPFIND", f"{h.url}/items/1") as response:
            assert response.status == 405

    h = run(test)
    assert h.count("/items/{item_id}", "GET", "200") == 2
    assert h.count("unmatched", "GET", "404") == 2
    assert h.count("unmatched", "POST", "405") == 1
    assert h.count("unmatched", "_OTHER", "405") == 1
    assert h.num_observed("/items/{item_id}") == 2 and h.num_observed("unmatched") == 4
    samples = [
        s.labels
        for family in h.metrics.registry.collect()
        if family.name == "mili_http_requests"
        for s in family.samples
        if s.name == "mili_http_requests_total"
    ]
    assert all("/1" not in labels["route"] and "nope" not in labels["route"] for labels in samples)
    names = sorted(s.name for s in h.spans() if s.kind is SpanKind.SERVER)
    assert names == ["GET", "GET", "GET /items/{item_id}", "GET /items/{item_id}", "HTTP", "POST"]
    other = dict(next(s for s in h.spans() if s.name == "HTTP").attributes or {})
    assert other["http.request.method"] == "_OTHER"
    assert other["http.request.method_original"] == "PROPFIND"


def test_a_5xx_logs_one_warning_line_and_other_requests_log_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def test(h: Harness, session: aiohttp.ClientSession) -> None:
        with caplog.at_level(logging.INFO, logger="mili.frontend"):
            caplog.clear()  # the server's start-up line, when an earlier test set INFO
            for path in ("/items/1", "/nope"):
                async with session.get(f"{h.url}{path}") as response:
                    assert response.status in (200, 404)
            assert not caplog.records
            async with session.get(f"{h.url}/boom", headers={"X-Request-Id": "r-5"}) as response:
                assert response.status == 500
                assert response.headers["X-Request-Id"] == "r-5"

    h = run(test)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    span = next(s for s in h.spans() if s.name == "GET /boom")
    ids = f"trace_id={span.context.trace_id:032x} span_id={span.context.span_id:016x}"
    assert re.fullmatch(
        rf"HTTP GET /boom -> 500 \(X-Request-Id 'r-5'\) after \d+\.\d ms {ids}", warnings[0]
    ), warnings[0]
    assert span.status.status_code is StatusCode.ERROR
    assert dict(span.attributes or {})["error.type"] == "500"
    assert h.count("/boom", "GET", "500") == 1


def test_a_client_that_goes_away_before_a_status_counts_as_499() -> None:
    async def test(h: Harness, session: aiohttp.ClientSession) -> None:
        with pytest.raises(asyncio.TimeoutError):
            async with session.get(f"{h.url}/hold", timeout=aiohttp.ClientTimeout(total=0.3)):
                pass
        deadline = time.monotonic() + 5
        while h.count("/hold", "GET", "499") is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    h = run(test)
    assert h.seen["held"]
    assert h.count("/hold", "GET", "499") == 1
    (span,) = h.spans()
    attributes = dict(span.attributes or {})
    assert attributes["error.type"] == "cancelled"
    assert "http.response.status_code" not in attributes


def test_a_stream_that_fails_after_its_headers_is_cut_short_not_followed_by_an_error() -> None:
    async def test(h: Harness, session: aiohttp.ClientSession) -> None:
        async with session.get(f"{h.url}/broken") as response:
            assert response.status == 200
            # Cut short: not a second HTTP response inside the body.
            with pytest.raises(aiohttp.ClientPayloadError):
                await response.read()

    h = run(test)
    assert h.count("/broken", "GET", "500") == 1  # what it ended in, not the 200 sent first
    assert h.count("/broken", "GET", "200") is None
    (span,) = h.spans()
    assert span.status.status_code is StatusCode.ERROR
    assert dict(span.attributes or {})["error.type"] == "500"


def test_a_request_aiohttp_cannot_parse_is_one_warning_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A control character in a header: aiohttp answers 400 and logged an ERROR with a
    traceback (anyone could fill the logs with them); now one WARNING line."""

    async def test(h: Harness, session: aiohttp.ClientSession) -> None:
        host, port = h.url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /items/1 HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\x01b\r\n\r\n")
        await writer.drain()
        assert (await reader.read(64)).startswith(b"HTTP/1.0 400")
        writer.close()

    with caplog.at_level(logging.DEBUG):
        run(test)
    records = [r for r in caplog.records if r.name == "mili.frontend.http"]
    assert [(r.levelname, r.exc_info) for r in records] == [("WARNING", None)], records
    assert records[0].getMessage().startswith("bad HTTP request: ")
