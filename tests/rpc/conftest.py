"""A raw-bytes echo service on a real RpcServer, for the mili.rpc tests.

pytest-asyncio is not a dependency: each test runs its own `asyncio.run(...)` and opens the
server inside it with `async with echo_server(config) as h:` (the fixture hands out the factory).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mili import errors
from mili.rpc.client import insecure_channel
from mili.rpc.server import RpcServer
from mili.rpc.server_config import ServerConfig

SERVICE = "mili.test.v1.EchoService"


class Echo:
    """mili.test.v1.EchoService over raw bytes (no serializers = identity).

    Every method raises `self.error` (when set) right after its first message, so one service
    covers "fails before any output" (unary) and "fails mid-stream" (streams).
    """

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.release = asyncio.Event()  # lets a held call finish
        self.num_holds_closed = 0  # Hold's `finally` ran (completed, cancelled or stopped)

    def _maybe_raise(self) -> None:
        if self.error is not None:
            raise self.error

    async def unary(self, request: bytes, context: Any) -> bytes:
        self._maybe_raise()
        return request

    async def server_stream(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield request
        self._maybe_raise()
        yield request

    async def server_stream_writer(self, request: bytes, context: Any) -> None:
        await context.write(request)  # the reader/writer API instead of an async generator
        self._maybe_raise()
        await context.write(request)

    async def client_stream(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        parts = []
        async for request in requests:
            parts.append(request)
            self._maybe_raise()
        return b"".join(parts)

    async def bidi_stream(
        self, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[bytes]:
        async for request in requests:
            yield request
            self._maybe_raise()

    async def abort(self, request: bytes, context: Any) -> bytes:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "caller may not do this")
        raise AssertionError("unreachable")

    async def hold(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        try:
            yield b"started"
            await self.release.wait()
            yield b"done"
        finally:
            self.num_holds_closed += 1

    async def late(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        """Fails with DEADLINE_EXCEEDED just as the caller's own deadline passes in grpc core:
        the status races the end of the call (what a request that waited out its deadline in a
        queue does)."""
        await asyncio.sleep(context.time_remaining() + 0.001)
        raise errors.DeadlineExceeded("the deadline passed while the request waited")
        yield request  # an async generator: a server stream with no messages

    def sync_unary(self, request: bytes, context: Any) -> bytes:
        return b"sync:" + request

    def register(self, server: grpc.aio.Server) -> None:
        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
                "ServerStream": grpc.unary_stream_rpc_method_handler(self.server_stream),
                "ServerStreamWriter": grpc.unary_stream_rpc_method_handler(
                    self.server_stream_writer
                ),
                "ClientStream": grpc.stream_unary_rpc_method_handler(self.client_stream),
                "BidiStream": grpc.stream_stream_rpc_method_handler(self.bidi_stream),
                "Abort": grpc.unary_unary_rpc_method_handler(self.abort),
                "Info": grpc.unary_unary_rpc_method_handler(self.unary),  # a control call
                "Hold": grpc.unary_stream_rpc_method_handler(self.hold),
                "SyncUnary": grpc.unary_unary_rpc_method_handler(self.sync_unary),
                "Late": grpc.unary_stream_rpc_method_handler(self.late),
            },
        )
        server.add_generic_rpc_handlers((handler,))


@dataclass
class Harness:
    server: RpcServer
    echo: Echo
    channel: grpc.aio.Channel

    def unary(self, method: str = "Unary") -> Any:
        return self.channel.unary_unary(f"/{SERVICE}/{method}")

    def server_stream(self, method: str = "ServerStream") -> Any:
        return self.channel.unary_stream(f"/{SERVICE}/{method}")

    def client_stream(self) -> Any:
        return self.channel.stream_unary(f"/{SERVICE}/ClientStream")

    def bidi_stream(self) -> Any:
        return self.channel.stream_stream(f"/{SERVICE}/BidiStream")

    async def health(self, service: str = "") -> str:
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return name


EchoServer = Callable[..., contextlib.AbstractAsyncContextManager[Harness]]


@contextlib.asynccontextmanager
async def _echo_server(
    config: ServerConfig | None = None, *, name: str = "echo", max_message_bytes: int = 1 << 26
) -> AsyncIterator[Harness]:
    echo = Echo()
    server = RpcServer(config or ServerConfig(drain_timeout_s=5.0, grace_s=1.0), name=name)
    server.add_service(SERVICE, echo.register)
    port = await server.start()
    async with insecure_channel(f"127.0.0.1:{port}", max_message_bytes=max_message_bytes) as ch:
        try:
            yield Harness(server, echo, ch)
        finally:
            echo.release.set()
            await server.drain()  # idempotent: fine when the test drained already


@pytest.fixture
def echo_server() -> EchoServer:
    """`async with echo_server(config) as h:` -> a started server with the echo service."""
    return _echo_server


async def eventually(check: Callable[[], Any], timeout_s: float = 3.0) -> None:
    """Poll `check` (sync or async, truthy = done) every 10 ms until it holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition still false after {timeout_s} s")
        await asyncio.sleep(0.01)


@pytest.fixture
def until() -> Callable[..., Any]:
    """`await until(lambda: ...)`: poll a condition (see `eventually`)."""
    return eventually
