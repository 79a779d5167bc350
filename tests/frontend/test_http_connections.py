"""The HTTP port bounds what a client can hold without sending a request: found by a review,
20,000 idle connections took every file of the frontend (its gRPC port stopped accepting too),
and connections that sent half their headers, or announced a body and sent a byte of it, were
all still open after 400 s."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from services.frontend.http_api.errors import (
    BODY_TIMEOUT_S,
    MAX_BODY_BYTES,
    openai_errors,
    read_body,
)
from services.frontend.http_api.server import HttpConfig, HttpServer

CONFIG = HttpConfig(port=0, idle_timeout_s=0.5, body_timeout_s=0.5, max_connections=4)


async def _echo(request: web.Request) -> web.Response:
    return web.json_response({"bytes": len(await read_body(request))})


@asynccontextmanager
async def _served() -> AsyncIterator[int]:
    app = web.Application(middlewares=[openai_errors])
    app[MAX_BODY_BYTES] = CONFIG.max_body_bytes
    app[BODY_TIMEOUT_S] = CONFIG.body_timeout_s
    app.router.add_post("/echo", _echo)
    server = HttpServer(app, CONFIG)
    port = await server.start()
    try:
        yield port
    finally:
        await server.drain()


async def _closed_within(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """Everything the server sent until it closed the connection (within `timeout_s`)."""
    async with asyncio.timeout(timeout_s):
        return await reader.read()


def _post(body: bytes, length: int) -> bytes:
    head = f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n"
    return head.encode() + body


def test_a_connection_that_sends_nothing_or_half_its_headers_is_closed() -> None:
    async def main() -> None:
        async with _served() as port:
            for sent in (b"", b"POST /echo HTTP/1.1\r\nHost: x\r\n"):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(sent)
                started = time.monotonic()
                assert await _closed_within(reader, 10) == b""
                assert time.monotonic() - started >= 0.4  # after the idle time, not at once
                writer.close()

    asyncio.run(main())


def test_a_body_that_does_not_arrive_in_time_is_408() -> None:
    async def main() -> None:
        async with _served() as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_post(b"{", 100))  # a byte of the 100 announced, then nothing
            async with asyncio.timeout(10):
                answer = await reader.readuntil(b"}}")  # the error's JSON
            writer.close()
            head, _, payload = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), answer
            error = json.loads(payload)["error"]
            assert error["code"] == "request_timeout" and "0.5 s" in error["message"]

    asyncio.run(main())


def test_connections_past_the_limit_are_closed_and_the_port_serves_on() -> None:
    async def main() -> None:
        async with _served() as port:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
            await asyncio.sleep(0.05)  # the server has registered them
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_post(b"{}", 2))
            assert await _closed_within(reader, 0.4) == b""  # at once, before any idle time
            writer.close()
            for _, held_writer in held:
                held_writer.close()
            await asyncio.sleep(0.05)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_post(b"{}", 2))
            answer = await reader.readuntil(b'{"bytes": 2}')
            writer.close()
            assert answer.startswith(b"HTTP/1.1 200"), answer

    asyncio.run(main())
