"""The HTTP port drains with the gRPC server (RpcServer.add_drain_hook, as serve-frontend wires
it): a request in flight finishes, new connections are refused, and one that outlasts
--drain-timeout is cancelled rather than holding the process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web

from mili.rpc.server import RpcServer
from mili.rpc.server_config import ServerConfig
from services.frontend.http_api.server import HttpConfig, HttpServer


class Held:
    """GET /hold answers once `release` is set; `entered` says the handler started."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.num_cancelled = 0

    async def hold(self, request: web.Request) -> web.Response:
        self.entered.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise
        return web.json_response({"done": True})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/hold", self.hold)
        return app


async def _until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _serve(held: Held, drain_timeout_s: float) -> tuple[RpcServer, HttpServer]:
    rpc = RpcServer(ServerConfig(port=0, drain_timeout_s=drain_timeout_s, grace_s=0.1), name="t")
    await rpc.start()
    http = HttpServer(held.app(), HttpConfig(port=0, drain_timeout_s=drain_timeout_s))
    await http.start()
    rpc.add_drain_hook(http.drain)
    return rpc, http


def test_a_drain_lets_the_request_in_flight_finish_and_refuses_new_connections() -> None:
    async def main() -> None:
        held = Held()
        rpc, http = await _serve(held, drain_timeout_s=10.0)
        async with aiohttp.ClientSession() as session:
            request = asyncio.create_task(session.get(f"{http.url}/hold"))
            await asyncio.wait_for(held.entered.wait(), 5)
            drain = asyncio.create_task(rpc.drain())
            await _until(lambda: rpc.is_draining)
            await asyncio.sleep(0.2)
            assert not drain.done() and not request.done()  # waiting for the held request
            async with aiohttp.ClientSession() as fresh:  # a new connection, not a pooled one
                with pytest.raises(aiohttp.ClientConnectionError):
                    await fresh.get(f"{http.url}/hold", timeout=aiohttp.ClientTimeout(total=2))
            held.release.set()
            response = await asyncio.wait_for(request, 5)
            assert response.status == 200 and await response.json() == {"done": True}
            await asyncio.wait_for(drain, 5)
        assert held.num_cancelled == 0

    asyncio.run(main())


def test_a_request_past_the_drain_timeout_is_cancelled_and_the_drain_ends() -> None:
    async def main() -> None:
        held = Held()
        rpc, http = await _serve(held, drain_timeout_s=0.5)
        async with aiohttp.ClientSession() as session:
            request = asyncio.create_task(session.get(f"{http.url}/hold"))
            await asyncio.wait_for(held.entered.wait(), 5)
            started = time.monotonic()
            await asyncio.wait_for(rpc.drain(), 10)
            assert time.monotonic() - started < 5
            with pytest.raises(aiohttp.ClientError):
                await asyncio.wait_for(request, 5)
        assert held.num_cancelled == 1

    asyncio.run(main())
