"""Draining the HTTP port the way RpcServer drains the gRPC one.

While draining, the port stays open so a load balancer (or a test) reads `GET /health` 503
rather than a refused connection; reads (GET: health, status, models) keep answering, requests
that would start work (POST) are refused with 503, and the requests in flight get up to the
drain timeout to finish. Those still running then are cut (mili.cut): a stream ends with an
error event saying so, a request not yet answered is a 503; then HttpServer closes the port.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from mili.cut import cut
from mili.errors import Unavailable
from services.frontend.http_api.errors import cut_error

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class DrainGate:
    """Counts the requests in flight; refuses new work once draining."""

    def __init__(self) -> None:
        self.is_draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._running: set[asyncio.Task[Any]] = set()  # the handlers' tasks, for `cut`

    def start_draining(self) -> None:
        self.is_draining = True

    def cut(self, why: str) -> int:
        """Cancel every request in flight with `why` (mili.cut): a stream ends with an error
        event saying it, any other request is a 503. Returns how many were cut."""
        return cut(list(self._running), why)

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
            task = asyncio.current_task()
            if task is not None:
                self._running.add(task)
            try:
                return await handler(request)
            except asyncio.CancelledError as exc:
                raise cut_error(exc) from None  # before its headers went out: a 503
            finally:
                if task is not None:
                    self._running.discard(task)
                self.num_in_flight -= 1
                if self.num_in_flight == 0:
                    self._idle.set()

        return drain_gate


DRAIN_GATE = web.AppKey("drain_gate", DrainGate)
