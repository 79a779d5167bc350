"""Draining the HTTP port the way RpcServer drains the gRPC one.

While draining, the port stays open so a load balancer (or a test) reads `GET /health` 503
rather than a refused connection; reads (GET: health, status, models) keep answering, requests
that would start work (POST) are refused with 503, and the requests in flight get up to the
drain timeout to finish. Only then does HttpServer close the port.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from mili.errors import Unavailable

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class DrainGate:
    """Counts the requests in flight; refuses new work once draining."""

    def __init__(self) -> None:
        self.is_draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def start_draining(self) -> None:
        self.is_draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Whether every request in flight ended within `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def middleware(self) -> Middleware:
        """The aiohttp middleware that counts and refuses (marked new-style, as aiohttp needs:
        a bound method cannot carry the mark)."""

        @web.middleware
        async def drain_gate(request: web.Request, handler: Handler) -> web.StreamResponse:
            if self.is_draining and request.method != "GET":
                raise Unavailable("the frontend is draining: send new requests elsewhere")
            self.num_in_flight += 1
            self._idle.clear()
            try:
                return await handler(request)
            finally:
                self.num_in_flight -= 1
                if self.num_in_flight == 0:
                    self._idle.set()

        return drain_gate


DRAIN_GATE = web.AppKey("drain_gate", DrainGate)
