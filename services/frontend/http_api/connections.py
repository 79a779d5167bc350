"""The HTTP port's open connections, bounded, and the site that listens for them.

aiohttp bounds neither. Past the process's open-file limit accept() fails for every port, the
gRPC one included, and asyncio logs each failure with a traceback: 20,000 idle connections
took the whole frontend down. So a connection counts from its `connection_made` until its
`connection_lost`; past the limit a new one is closed at once, unserved.

On a TLS port asyncio calls `connection_made` only once the handshake is done, and tells the
app's protocol nothing of a handshake that failed: a connection counts from its handshake's
end, and the handshake itself is bounded by HANDSHAKE_TIMEOUT_S (asyncio's default is 60 s).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable

from aiohttp import web

_LOG = logging.getLogger("mili.frontend")
# A TLS handshake longer than this is given up (a real client's takes milliseconds).
HANDSHAKE_TIMEOUT_S = 10.0


class ConnectionLimit:
    """How many connections are open, and the most that may be."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_open = 0
        self._warned_at: float | None = None

    def protocol_factory(
        self, make: Callable[[], asyncio.Protocol]
    ) -> Callable[[], asyncio.Protocol]:
        """`make` (aiohttp's server: a RequestHandler per connection), counted."""
        return lambda: _Counted(make(), self)

    def warn_full(self) -> None:
        now = asyncio.get_running_loop().time()
        if self._warned_at is None or now - self._warned_at > 60:  # a line a minute at most
            self._warned_at = now
            _LOG.warning("frontend: %d HTTP connections open: closing new ones", self.limit)


class _Counted(asyncio.Protocol):
    """aiohttp's protocol of one connection, counted from connection_made to connection_lost
    (asyncio calls each once, in that order)."""

    def __init__(self, inner: asyncio.Protocol, limit: ConnectionLimit) -> None:
        self._inner = inner
        self._limit = limit

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._limit.num_open += 1
        if self._limit.num_open > self._limit.limit:
            self._limit.warn_full()
            assert isinstance(transport, asyncio.Transport)
            transport.abort()  # connection_lost follows, and uncounts it
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._limit.num_open -= 1
        self._inner.connection_lost(exc)


class LimitedSite(web.BaseSite):
    """aiohttp's TCPSite, its connections counted against `limit` (ConnectionLimit) and its TLS
    handshakes bounded by HANDSHAKE_TIMEOUT_S."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        limit: ConnectionLimit,
        *,
        ssl_context: ssl.SSLContext | None,
        reuse_port: bool,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._host, self._port = host, port
        self._limit = limit
        self._reuse_port = reuse_port

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._limit.protocol_factory(server),
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=True,
            reuse_port=self._reuse_port,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if self._ssl_context else None,
        )
