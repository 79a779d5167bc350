"""Graceful drain: NOT_SERVING, new calls refused, in-flight calls finish; also via SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from mili.rpc.client import insecure_channel
from mili.rpc.server_config import ServerConfig

SERVICE = "mili.test.v1.EchoService"
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_drain_lets_in_flight_call_finish(echo_server: Any, until: Any) -> None:
    async def main() -> None:
        async with echo_server(ServerConfig(drain_timeout_s=10.0, grace_s=1.0)) as h:
            held = h.server_stream("Hold")(b"")
            assert await held.read() == b"started"
            assert h.server.num_in_flight == 1

            drain = asyncio.create_task(h.server.drain())
            await until(lambda: h.server.is_draining)
            # Health keeps answering during the drain, and says NOT_SERVING everywhere.
            assert await h.health("") == "NOT_SERVING"
            assert await h.health(SERVICE) == "NOT_SERVING"
            assert SERVICE in await _list_services(h.channel)  # reflection answers too
            # New application calls are refused with a message saying what to do.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.unary()(b"late")
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
            assert info.value.details() == "echo is draining; retry on another instance"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.client_stream()(_one(b"late"))
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
            assert h.server.num_in_flight == 1  # refused calls are not counted

            await asyncio.sleep(0.1)
            assert not drain.done()  # still waiting for the held call
            h.echo.release.set()
            assert await held.read() == b"done"
            assert await held.read() is grpc.aio.EOF
            assert await held.code() is grpc.StatusCode.OK

            await asyncio.wait_for(drain, timeout=5.0)
            await asyncio.wait_for(h.server.wait(), timeout=1.0)
            assert h.server.num_in_flight == 0
            assert h.echo.num_holds_closed == 1
            await h.server.drain()  # idempotent

    asyncio.run(main())


async def _one(message: Any) -> Any:
    yield message


async def _list_services(channel: grpc.aio.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    [reply] = [r async for r in stub.ServerReflectionInfo(_one(request))]
    return {s.name for s in reply.list_services_response.service}


def test_drain_timeout_stops_stuck_call(
    echo_server: Any, until: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async with echo_server(ServerConfig(drain_timeout_s=0.3, grace_s=0.1)) as h:
            held = h.server_stream("Hold")(b"")
            assert await held.read() == b"started"
            started = time.monotonic()
            await asyncio.gather(h.server.drain(), h.server.drain())  # concurrent callers
            elapsed = time.monotonic() - started
            assert 0.3 <= elapsed < 2.0
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await held.read()
            # Cut by the server, saying so (grpc's own stop sent a bare CANCELLED or
            # UNAVAILABLE, and the handler could not tell the cut from its caller going away).
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert info.value.details() == (
                "echo stopped before this call finished: its drain timeout (0.3 s) ran out"
            )
            # The stuck handler was cancelled: its `finally` ran and the count is back to 0.
            await until(lambda: h.echo.num_holds_closed == 1)
            assert h.server.num_in_flight == 0

    with caplog.at_level(logging.INFO, logger="mili.rpc"):
        asyncio.run(main())
    messages = [r.getMessage() for r in caplog.records if r.name == "mili.rpc"]
    assert any("draining; 1 call in flight, waiting up to 0.3 s" in m for m in messages)
    assert any(
        "1 gRPC call still in flight, cut short (UNAVAILABLE), stopping with 0.1 s grace" in m
        for m in messages
    )


def test_client_cancel_releases_in_flight_count(echo_server: Any, until: Any) -> None:
    async def main() -> None:
        async with echo_server() as h:
            held = h.server_stream("Hold")(b"")
            assert await held.read() == b"started"
            assert h.server.num_in_flight == 1
            held.cancel()
            await until(lambda: h.server.num_in_flight == 0)
            await until(lambda: h.echo.num_holds_closed == 1)

    asyncio.run(main())


# ---- a real process and a real SIGTERM ---------------------------------------------------------

SCRIPT = """
import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mili.rpc.server import RpcServer, serve_forever
from mili.rpc.server_config import ServerConfig


async def unary(request, context):
    return request


async def chat(requests, context):
    async for request in requests:
        yield b"ack:" + request


def register(server):
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Chat": grpc.stream_stream_rpc_method_handler(chat),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("mili.test.v1.EchoService", handlers),)
    )


server = RpcServer(ServerConfig(drain_timeout_s=20.0, grace_s=1.0), name="sigterm-test")
server.add_service("mili.test.v1.EchoService", register)
asyncio.run(serve_forever(server))
"""


async def _spawn(tmp_path: Path) -> tuple[asyncio.subprocess.Process, int]:
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), timeout=15.0)).decode()
    match = re.fullmatch(r"sigterm-test service listening on 127\.0\.0\.1:(\d+)\n", line)
    assert match, f"unexpected first line {line!r}"
    return proc, int(match.group(1))


async def _health(channel: grpc.aio.Channel) -> str:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=SERVICE), timeout=2
    )
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return name


def test_sigterm_drains_and_exits_zero(tmp_path: Path, until: Any) -> None:
    async def main() -> None:
        proc, port = await _spawn(tmp_path)
        try:
            async with insecure_channel(f"127.0.0.1:{port}") as channel:
                assert await _health(channel) == "SERVING"
                chat = channel.stream_stream(f"/{SERVICE}/Chat")()
                await chat.write(b"1")
                assert await chat.read() == b"ack:1"

                proc.send_signal(signal.SIGTERM)
                await until(lambda: _is(channel, "NOT_SERVING"), timeout_s=5.0)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await channel.unary_unary(f"/{SERVICE}/Unary")(b"late")
                assert info.value.code() is grpc.StatusCode.UNAVAILABLE
                assert info.value.details() == (
                    "sigterm-test is draining; retry on another instance"
                )

                # The in-flight stream is still fully usable, then finishes cleanly.
                await chat.write(b"2")
                assert await chat.read() == b"ack:2"
                await chat.done_writing()
                assert await chat.read() is grpc.aio.EOF
                assert await chat.code() is grpc.StatusCode.OK

            assert await asyncio.wait_for(proc.wait(), timeout=10.0) == 0
            assert proc.stderr is not None
            stderr = (await proc.stderr.read()).decode()
            assert "Traceback" not in stderr, stderr
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    asyncio.run(main())


def test_second_sigterm_skips_the_drain_wait(tmp_path: Path, until: Any) -> None:
    async def main() -> None:
        proc, port = await _spawn(tmp_path)
        try:
            async with insecure_channel(f"127.0.0.1:{port}") as channel:
                chat = channel.stream_stream(f"/{SERVICE}/Chat")()
                await chat.write(b"1")
                assert await chat.read() == b"ack:1"
                proc.send_signal(signal.SIGTERM)
                await until(lambda: _is(channel, "NOT_SERVING"), timeout_s=5.0)
                started = time.monotonic()
                proc.send_signal(signal.SIGINT)
                # drain_timeout_s is 20 s: exiting quickly means the second signal cut it short.
                assert await asyncio.wait_for(proc.wait(), timeout=10.0) == 0
                assert time.monotonic() - started < 5.0
                with pytest.raises(grpc.aio.AioRpcError):
                    await chat.read()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    asyncio.run(main())


async def _is(channel: grpc.aio.Channel, status: str) -> bool:
    return await _health(channel) == status
