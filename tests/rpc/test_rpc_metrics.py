"""RpcServer's request counter (mili_requests_total{method,status}) and /metrics endpoint, on
a real server: each call is counted once under its final status; health checks are not."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mili.errors import InvalidArgument
from mili.rpc.server import ServerConfig
from tests.rpc.conftest import SERVICE, EchoServer


def _counts(text: str) -> dict[tuple[str, str], float]:
    return {
        (s.labels["method"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "mili_requests"
        for s in family.samples
        if s.name == "mili_requests_total"
    }


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return str(reply.read().decode())


def test_calls_are_counted_by_method_and_final_status(
    echo_server: EchoServer, until: Callable[..., Any]
) -> None:
    async def main() -> None:
        config = ServerConfig(drain_timeout_s=2.0, grace_s=0.1, metrics_port=0)
        async with echo_server(config) as h:
            url = h.server.metrics_url
            assert url is not None and url.startswith("http://127.0.0.1:")
            assert await h.health() == "SERVING"
            await h.unary()(b"x")
            assert b"".join([r async for r in h.server_stream()(b"y")]) == b"yy"
            with pytest.raises(grpc.aio.AioRpcError):
                await h.unary("Abort")(b"x")
            h.echo.error = InvalidArgument("field", 1, "is bad")
            with pytest.raises(grpc.aio.AioRpcError):
                await h.unary()(b"x")
            h.echo.error = None
            held = h.server_stream("Hold")(b"x")
            assert await held.read() == b"started"
            held.cancel()
            await until(lambda: h.echo.num_holds_closed == 1)
            counts = await asyncio.to_thread(lambda: _counts(_get(url)))
            assert counts == {
                (f"/{SERVICE}/Unary", "OK"): 1,
                (f"/{SERVICE}/ServerStream", "OK"): 1,
                (f"/{SERVICE}/Abort", "PERMISSION_DENIED"): 1,
                (f"/{SERVICE}/Unary", "INVALID_ARGUMENT"): 1,
                (f"/{SERVICE}/Hold", "CANCELLED"): 1,
            }
            await h.server.drain()
            with pytest.raises(urllib.error.URLError):  # the endpoint stops with the server
                await asyncio.to_thread(_get, url)

    asyncio.run(main())


def test_no_metrics_port_serves_no_metrics(echo_server: EchoServer) -> None:
    async def main() -> None:
        async with echo_server() as h:
            assert h.server.metrics_url is None
            await h.unary()(b"x")  # still counted in the registry, just not served
            counts = _counts(generate_latest(h.server.registry).decode())
            assert counts == {(f"/{SERVICE}/Unary", "OK"): 1}

    asyncio.run(main())
