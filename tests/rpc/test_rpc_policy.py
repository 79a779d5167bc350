"""Each method's request limit and callers (mili.rpc.policy), on a real RpcServer: a message
over its method's limit is RESOURCE_EXHAUSTED before it is parsed, grpc is told the largest
limit (and refuses more from the length prefix), and a caller the method does not take is
PERMISSION_DENIED before the servicer runs or reads a message."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from mili.discovery import Callers, PeerSet, format_address, parse_targets
from mili.errors import InvalidArgument
from mili.pb.tokenizer.v1.tokenizer_pb2 import DetokenizeRequest, DetokenizeResponse
from mili.rpc import heap
from mili.rpc.client import insecure_channel
from mili.rpc.malformed import Oversized, guard
from mili.rpc.policy import SMALL_REQUEST_BYTES, Policy
from mili.rpc.server import RpcServer
from mili.rpc.server_config import ServerConfig
from mili.rpc.status import server_status_of
from tests.rpc.conftest import SERVICE, Echo
from tests.rpc.eventually import eventually

ELSEWHERE = Callers("--frontend", PeerSet(parse_targets(["127.0.0.9:50051"])))  # not us


class Counting(Echo):
    """The echo service, counting the calls and the stream messages its methods got."""

    def __init__(self) -> None:
        super().__init__()
        self.num_calls = 0
        self.num_read = 0

    async def unary(self, request: bytes, context: Any) -> bytes:
        self.num_calls += 1
        return await super().unary(request, context)

    async def client_stream(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        self.num_calls += 1
        parts = []
        async for request in requests:
            self.num_read += 1
            parts.append(request)
        return b"".join(parts)


@contextlib.asynccontextmanager
async def _server(
    policy: Policy, host: str = "127.0.0.1"
) -> AsyncIterator[tuple[RpcServer, Counting, grpc.aio.Channel]]:
    echo = Counting()
    server = RpcServer(ServerConfig(host=host, drain_timeout_s=1.0, grace_s=0.1), name="echo")
    server.add_service(SERVICE, echo.register, policy)
    port = await server.start()
    async with insecure_channel(format_address(host, port)) as channel:
        try:
            yield server, echo, channel
        finally:
            await server.drain()


def _count(server: RpcServer, method: str, code: str) -> float:
    value = server.registry.get_sample_value(
        "mili_requests_total",
        {"grpc_service": SERVICE, "grpc_method": method, "status": code},
    )
    return value or 0.0


async def _stream(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def test_each_method_has_its_own_limit_checked_before_parsing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limits = {"Unary": 1000, "ClientStream": 100_000, "BidiStream": 200_000}
    policy = Policy(max_request_bytes=limits)

    async def main() -> None:
        async with _server(policy) as (server, echo, channel):
            # grpc is told the largest limit; the rest are ours, checked on each message's length
            assert server.receive_limit == 200_000
            unary = channel.unary_unary(f"/{SERVICE}/Unary")
            assert await unary(b"x" * 1000) == b"x" * 1000
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await unary(b"x" * 1001)
            assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert caught.value.details() == (
                f"request to /{SERVICE}/Unary is 1001 bytes, over its limit of 1000 bytes"
            )
            assert echo.num_calls == 1  # the servicer never saw it
            assert await eventually(lambda: _count(server, "Unary", "RESOURCE_EXHAUSTED")) == 1

            # A method without a limit of its own takes SMALL_REQUEST_BYTES.
            stream = channel.unary_stream(f"/{SERVICE}/ServerStream")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stream(b"y" * (SMALL_REQUEST_BYTES + 1)).read()
            assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED

            # Past the largest limit, grpc refuses from the length prefix, unread.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await unary(b"z" * 200_001)
            assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in (caught.value.details() or "")

            # A request stream: every message is checked as the servicer reads it.
            client_stream = channel.stream_unary(f"/{SERVICE}/ClientStream")
            ok = await client_stream(_stream(b"a" * 90_000, b"b" * 90_000))
            assert len(ok) == 180_000
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client_stream(_stream(b"a" * 10, b"b" * 150_000, b"c" * 10))
            # (a write racing a refusal can make grpc report INTERNAL over it: the server's
            # status also rides the initial metadata)
            assert server_status_of(caught.value).code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert echo.num_read == 3  # two, then the first before the refused one
            assert server.num_in_flight == 0

    with caplog.at_level(logging.WARNING, logger="mili.rpc"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "over its limit" in r.getMessage()]
    assert len(lines) == 3, lines  # one WARNING line per refusal
    assert f"request to /{SERVICE}/Unary from ipv4:127.0.0.1:" in lines[0]
    assert all(r.exc_info is None for r in caplog.records)


def test_a_caller_outside_the_methods_callers_is_refused_before_the_servicer_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = Policy(callers={"Unary": ELSEWHERE, "ClientStream": ELSEWHERE})

    async def main() -> None:
        async with _server(policy) as (server, echo, channel):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await channel.unary_unary(f"/{SERVICE}/Unary")(b"hello")
            assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
            details = caught.value.details() or ""
            assert details.startswith(f"/{SERVICE}/Unary takes calls only from --frontend ")
            assert "127.0.0.9:50051; ipv4:127.0.0.1:" in details
            # A request stream is refused before its first message is read.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await channel.stream_unary(f"/{SERVICE}/ClientStream")(_stream(b"a", b"b"))
            assert server_status_of(caught.value).code is grpc.StatusCode.PERMISSION_DENIED
            assert (echo.num_calls, echo.num_read) == (0, 0)
            assert _count(server, "Unary", "PERMISSION_DENIED") == 1
            # The methods it does not guard answer anyone.
            assert await channel.unary_unary(f"/{SERVICE}/Info")(b"hi") == b"hi"

    with caplog.at_level(logging.WARNING, logger="mili.rpc"):
        asyncio.run(main())
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 2, refused
    assert refused[0].startswith(f"echo: refused /{SERVICE}/Unary from ipv4:127.0.0.1:")


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_this_machine_is_the_default_set_of_callers(host: str) -> None:
    """Over IPv6 too: grpc writes such a peer percent-encoded (`ipv6:%5B::1%5D:port`), which
    once failed every guarded call with INTERNAL."""
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    policy = Policy(callers={"Unary": Callers("--frontend")})

    async def main() -> None:
        async with _server(policy, host) as (_, echo, channel):
            assert await channel.unary_unary(f"/{SERVICE}/Unary")(b"hello") == b"hello"
            assert echo.num_calls == 1

    asyncio.run(main())


def test_a_service_without_a_policy_takes_anyone_up_to_the_servers_limit() -> None:
    async def main() -> None:
        server = RpcServer(ServerConfig(max_message_bytes=3 << 20), name="echo")
        server.add_service(SERVICE, Echo().register)
        assert server.receive_limit == 3 << 20
        other = RpcServer(ServerConfig(), name="small")
        other.add_service(SERVICE, Echo().register, Policy(max_request_bytes={"Unary": 10}))
        assert other.receive_limit == SMALL_REQUEST_BYTES  # health and reflection's

    asyncio.run(main())


def test_policies_refuse_limits_that_are_not_positive() -> None:
    with pytest.raises(ValueError, match="> 0"):
        Policy(max_request_bytes={"Unary": 0})
    with pytest.raises(ValueError, match="> 0"):
        Policy(default_request_bytes=0)
    assert Policy().request_bytes("Info", 1 << 20) == SMALL_REQUEST_BYTES
    assert Policy(default_request_bytes=None).request_bytes("Info", 1 << 20) == 1 << 20
    assert Policy(max_request_bytes={"Big": 8 << 20}).request_bytes("Big", 1 << 20) == 1 << 20


def test_large_requests_of_one_burst_share_one_heap_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    # An earlier test's burst may still have its trim pending (module state): let it land
    # before this test counts trims.
    deadline = time.monotonic() + 10
    while heap._first is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    trims: list[int] = []
    monkeypatch.setattr(heap, "_TRIM", trims.append)
    # A quiet second ends a burst: far longer than the gaps below, even on a loaded machine.
    monkeypatch.setattr(heap, "_QUIET_S", 1.0)
    monkeypatch.setattr(heap, "_SETTLE_S", 2.0)
    monkeypatch.setattr(heap, "LARGE_REQUEST_BYTES", 100)
    unary, stream = guard(None, 1000), guard(None, 1000, is_request_streaming=True)
    assert unary(b"x" * 99) == b"x" * 99 and stream(b"y" * 500) == b"y" * 500
    time.sleep(1.2)
    assert trims == []  # small, or a stream's (KV chunks are megabytes all the time)
    for _ in range(5):
        assert unary(b"x" * 1001) == Oversized(1001, 1000)
        assert unary(b"x" * 500) == b"x" * 500
        time.sleep(0.02)
    assert trims == []  # the burst is not over
    time.sleep(1.5)
    assert trims == [0]  # malloc_trim(0), once for the burst ...
    time.sleep(2.5)
    assert trims == [0, 0]  # ... and once more for what its handlers freed afterwards
    deadline = time.monotonic() + 10
    while heap._first is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert heap._first is None and trims == [0, 0]  # the round is over


def test_a_refused_request_does_not_outlive_its_call() -> None:
    """The servicer's InvalidArgument (its traceback holds the frames that hold the request)
    is chained by grpc's abort, which grpc keeps in a reference cycle: without the interceptor
    dropping those tracebacks, every refused request stayed until a full collection."""

    class Refusing:
        async def unary(self, request: Any, context: Any) -> Any:
            ids = tuple(request.token_ids)  # a local the traceback's frame keeps
            raise InvalidArgument("token_ids", f"{len(ids)} ids", "too many")

        def register(self, server: grpc.aio.Server) -> None:
            handler = grpc.unary_unary_rpc_method_handler(
                self.unary,
                request_deserializer=DetokenizeRequest.FromString,
                response_serializer=DetokenizeResponse.SerializeToString,
            )
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(SERVICE, {"Unary": handler}),)
            )

    def alive(sent: DetokenizeRequest) -> int:
        return sum(
            1
            for o in gc.get_objects()
            if type(o) is DetokenizeRequest and o is not sent and len(o.token_ids) > 1000
        )

    async def main() -> None:
        server = RpcServer(ServerConfig(drain_timeout_s=1.0, grace_s=0.1), name="refusing")
        server.add_service(SERVICE, Refusing().register, Policy(default_request_bytes=None))
        port = await server.start()
        request = DetokenizeRequest(token_ids=[7] * 100_000)
        async with insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(
                f"/{SERVICE}/Unary",
                request_serializer=DetokenizeRequest.SerializeToString,
                response_deserializer=DetokenizeResponse.FromString,
            )
            gc.collect()
            gc.disable()
            try:
                for _ in range(3):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await call(request)
                    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                await asyncio.sleep(0.1)
                assert alive(request) == 0
            finally:
                gc.enable()
        await server.drain()

    asyncio.run(main())
