"""RpcServer: config validation, health, reflection, message limits, binding."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from mili.discovery import format_address
from mili.errors import StartupError
from mili.rpc.client import channel_options, insecure_channel
from mili.rpc.server import RpcServer
from mili.rpc.server_config import ServerConfig

SERVICE = "mili.test.v1.EchoService"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"port": -1},
        {"port": 70000},
        {"max_message_bytes": 0},
        {"max_receive_message_bytes": 0},
        {"receive_window_bytes": -1},
        {"drain_timeout_s": -1.0},
        {"grace_s": -0.5},
        # found by a flag review: grpc's C ints overflowed at bind, NaN skipped the drain
        {"max_message_bytes": 2**31},
        {"max_receive_message_bytes": 2**31},
        {"receive_window_bytes": 2**31},
        {"drain_timeout_s": float("nan")},
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, Any]) -> None:
    (field,) = kwargs
    with pytest.raises(ValueError, match=field):
        ServerConfig(**kwargs)


def test_format_address_brackets_ipv6() -> None:
    assert format_address("127.0.0.1", 50051) == "127.0.0.1:50051"
    assert format_address("::", 7) == "[::]:7"
    assert format_address("[::1]", 7) == "[::1]:7"


def test_channel_options_match_limits() -> None:
    options = dict(channel_options(1234))
    assert options["grpc.max_send_message_length"] == 1234
    assert options["grpc.max_receive_message_length"] == 1234
    assert options["grpc.keepalive_time_ms"] > 0
    # A peer restarted on its address is found again within seconds (grpc's default: 120 s).
    assert options["grpc.max_reconnect_backoff_ms"] <= 2_000
    with pytest.raises(ValueError):
        channel_options(0)
    assert "grpc.http2.lookahead_bytes" not in options  # BDP probing sizes it by default
    fixed = dict(channel_options(1234, receive_window_bytes=65536))
    assert (fixed["grpc.http2.bdp_probe"], fixed["grpc.http2.lookahead_bytes"]) == (0, 65536)


def test_health_serving_after_start(echo_server: Any) -> None:
    async def main() -> None:
        async with echo_server() as h:
            assert h.server.port > 0
            assert await h.health("") == "SERVING"
            assert await h.health(SERVICE) == "SERVING"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.health("mili.test.v1.NoSuchService")
            assert info.value.code() is grpc.StatusCode.NOT_FOUND
            assert await h.unary()(b"ping") == b"ping"
            assert h.server.num_in_flight == 0

    asyncio.run(main())


def test_a_burst_of_calls_past_grpcs_default_backlog_is_served(echo_server: Any) -> None:
    """3000 calls at once on one channel: grpc's default backlog of calls the loop has not
    picked up (1000) cut a quarter of them with a bare CANCELLED (an HTTP request with n=128
    choices sends 128 Tokenize calls at once); RpcServer raises it, so every call runs."""

    async def main() -> None:
        async with echo_server() as h:
            unary = h.unary()

            async def one(i: int) -> str:
                try:
                    reply = await unary(str(i).encode(), timeout=60)
                except grpc.aio.AioRpcError as err:
                    return err.code().name
                return "OK" if reply == str(i).encode() else "WRONG"

            results = await asyncio.gather(*(one(i) for i in range(3000)))
            assert {r: results.count(r) for r in set(results)} == {"OK": 3000}

    asyncio.run(main())


def test_set_serving_switches_health_until_a_drain_wins(echo_server: Any, until: Any) -> None:
    async def main() -> None:
        async with echo_server() as h:
            await h.server.set_serving(False)
            assert await h.health("") == await h.health(SERVICE) == "NOT_SERVING"
            assert await h.unary()(b"ping") == b"ping"  # calls are still taken
            await h.server.set_serving(True)
            assert await h.health("") == await h.health(SERVICE) == "SERVING"

            held = h.server_stream("Hold")(b"")
            assert await held.read() == b"started"  # keeps the drain going
            drain = asyncio.create_task(h.server.drain())
            await until(lambda: h.server.is_draining)
            await h.server.set_serving(True)  # a late "backends are back" must not undo it
            assert await h.health("") == await h.health(SERVICE) == "NOT_SERVING"
            h.echo.release.set()
            await drain

    asyncio.run(main())


def test_set_serving_before_start_is_where_it_starts() -> None:
    async def main() -> None:
        server = RpcServer(ServerConfig(), name="echo")
        server.add_service(SERVICE, lambda s: None)
        await server.set_serving(False)
        port = await server.start()
        try:
            async with insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            await server.drain()

    asyncio.run(main())


def test_reflection_lists_services(echo_server: Any) -> None:
    async def main() -> None:
        async with echo_server() as h:
            stub = reflection_pb2_grpc.ServerReflectionStub(h.channel)

            async def ask() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            replies = [r async for r in stub.ServerReflectionInfo(ask())]
            names = {s.name for s in replies[0].list_services_response.service}
            assert names == {
                SERVICE,
                "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection",
            }

    asyncio.run(main())


def test_message_size_limit(echo_server: Any) -> None:
    async def main() -> None:
        async with echo_server(ServerConfig(max_message_bytes=1024)) as h:
            assert await h.unary()(b"x" * 1000) == b"x" * 1000
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.unary()(b"x" * 2048)
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "1024" in (info.value.details() or "")
            # grpc rejected it before any handler ran: nothing leaked into the count.
            assert h.server.num_in_flight == 0

    asyncio.run(main())


def test_receive_limit_tighter_than_send_limit(echo_server: Any) -> None:
    """The frontend's case: small requests, large replies."""

    async def main() -> None:
        config = ServerConfig(max_message_bytes=1 << 20, max_receive_message_bytes=1024)
        async with echo_server(config) as h:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.unary()(b"x" * 2048)
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "1024" in (info.value.details() or "")

            async def parts() -> AsyncIterator[bytes]:
                for _ in range(8):
                    yield b"y" * 1000

            assert await h.client_stream()(parts()) == b"y" * 8000  # a reply over 1024 B

    asyncio.run(main())


def test_fixed_receive_window_still_takes_messages_larger_than_it(echo_server: Any) -> None:
    async def main() -> None:
        async with echo_server(ServerConfig(receive_window_bytes=64 * 1024)) as h:
            big = b"z" * (1 << 20)
            assert await h.unary()(big) == big

    asyncio.run(main())


def test_port_in_use_is_a_startup_error(echo_server: Any) -> None:
    async def main() -> None:
        async with echo_server() as h:
            other = RpcServer(ServerConfig(port=h.server.port), name="second")
            with pytest.raises(
                StartupError, match=f"second: cannot listen on 127.0.0.1:{h.server.port}"
            ):
                await other.start()

    asyncio.run(main())


def test_servers_share_a_reuse_port_and_connections_spread_over_them() -> None:
    """`mili serve --frontends N`: processes bound with reuse_port share one port, the kernel
    hands each connection to one of them; a server without it still may not join."""

    def answering(name: bytes) -> Any:
        async def who(request: bytes, context: Any) -> bytes:
            return name

        handler = grpc.method_handlers_generic_handler(
            SERVICE, {"Unary": grpc.unary_unary_rpc_method_handler(who)}
        )
        return lambda server: server.add_generic_rpc_handlers((handler,))

    async def main() -> None:
        first = RpcServer(ServerConfig(reuse_port=True, grace_s=0), name="first")
        first.add_service(SERVICE, answering(b"first"))
        port = await first.start()
        second = RpcServer(ServerConfig(port=port, reuse_port=True, grace_s=0), name="second")
        second.add_service(SERVICE, answering(b"second"))
        assert await second.start() == port
        try:
            alone = RpcServer(ServerConfig(port=port), name="alone")
            with pytest.raises(StartupError, match=f"alone: cannot listen on 127.0.0.1:{port}"):
                await alone.start()
            # 24 connections land on one server alone with probability 2 / 2**24
            channels = [
                insecure_channel(f"127.0.0.1:{port}", own_connection=True) for _ in range(24)
            ]
            try:
                calls = [c.unary_unary(f"/{SERVICE}/Unary")(b"?", timeout=5) for c in channels]
                answers = await asyncio.gather(*calls)
            finally:
                for c in channels:
                    await c.close()
            assert set(answers) == {b"first", b"second"}
            # without own connections, channels of one process share one: one server answers
            shared = [insecure_channel(f"127.0.0.1:{port}") for _ in range(8)]
            try:
                calls = [c.unary_unary(f"/{SERVICE}/Unary")(b"?", timeout=5) for c in shared]
                assert len(set(await asyncio.gather(*calls))) == 1
            finally:
                for c in shared:
                    await c.close()
        finally:
            await second.drain()
            await first.drain()

    asyncio.run(main())


def test_lifecycle_misuse_is_refused() -> None:
    async def main() -> None:
        server = RpcServer(ServerConfig(grace_s=0), name="once")
        with pytest.raises(RuntimeError, match="before start"):
            await server.drain()
        server.add_service(SERVICE, lambda s: None)
        with pytest.raises(ValueError, match="added twice"):
            server.add_service(SERVICE, lambda s: None)
        await server.start()
        with pytest.raises(RuntimeError, match="after start"):
            server.add_service("mili.test.v1.Other", lambda s: None)
        with pytest.raises(RuntimeError, match="twice"):
            await server.start()
        await server.drain()
        await server.wait()

    asyncio.run(main())
