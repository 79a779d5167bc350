"""The frontend's HTTP port: an aiohttp server in the frontend's own event loop.

aiohttp because it runs inside the loop grpc.aio already runs (AppRunner + TCPSite: no loop or
signal handling of its own to work around, as uvicorn's has), parses HTTP in C, streams
responses (SSE) with back-pressure, and cancels a handler whose client went away
(`handler_cancellation`): a closed connection ends the request end to end. Routes come from the
API modules beside this one; they share the frontend's Generations (no extra hop, no second
tokenization).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import ssl
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_protocol import RequestPayloadError

from mili.cut import CUT_WAIT_S, drain_ran_out, second_signal
from mili.discovery import format_address
from mili.plural import plural
from mili.ports import pick_free
from mili.rpc.tls import TlsFiles
from services.frontend.http_api.connections import ConnectionLimit, LimitedSite
from services.frontend.http_api.drain import DRAIN_GATE

_LOG = logging.getLogger("mili.frontend")


class _BadRequests(logging.Filter):
    """aiohttp logs a request it cannot parse (a control character in a header, a broken
    request line, a body that does not decode, which it reads again after the handler
    answered: anyone can send one) as an ERROR with a traceback; it answered 400, and the
    client's mistake is one WARNING line here. Other errors pass as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, RequestPayloadError):  # the body's: BadHttpMessage is its cause
            error = error.__cause__
        if isinstance(error, BadHttpMessage):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            reason = " ".join(str(error.message).split())[:200]
            record.msg, record.args, record.exc_info = "bad HTTP request: %s", (reason,), None
            record.exc_text = None
        return True


# aiohttp's server log (errors handling a request), with bad requests one line each.
_SERVER_LOG = logging.getLogger("mili.frontend.http")
_SERVER_LOG.addFilter(_BadRequests())
# The largest request body read: the gRPC port's limit (services/frontend/__main__.py says why
# a valid request fits in it); past it, 413 before the body is read.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Once the drain's own wait is over: how long responses already returned get to finish
# writing, and requests still running to see their cancellation, before the port closes.
CLOSE_GRACE_S = 1.0


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # How long a drain waits for requests in flight before cancelling them.
    drain_timeout_s: float = 30.0
    tls: TlsFiles | None = None  # None: plaintext
    require_client_auth: bool = False  # mTLS: only clients with a certificate tls.ca signed
    # SO_REUSEPORT: the port is shared with sibling frontend processes (ServerConfig.reuse_port)
    reuse_port: bool = False
    # A connection with no request under way (a new one, one between requests, one whose
    # request line and headers are still coming) is closed after this long.
    idle_timeout_s: float = 60.0
    # The most a request's body may take to arrive once its headers did (408 past it).
    body_timeout_s: float = 60.0
    # Connections open at once; past it a new one is closed at once. 0: half this process's
    # open-file limit, so that idle clients never take the files gRPC and the downstream
    # channels need.
    max_connections: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:  # (unchecked, it failed at bind, after the backends)
            raise ValueError(
                f"--http-port must be in [0, 65535] (0 = any free port), got {self.port}"
            )
        for name in ("idle_timeout_s", "body_timeout_s"):  # 0 turned a limit off, or made
            if not getattr(self, name) > 0:  # every body a 408
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_connections < 0:
            raise ValueError(f"max_connections must be >= 0, got {self.max_connections}")


def ssl_context(tls: TlsFiles, *, require_client_auth: bool) -> ssl.SSLContext:
    """The HTTP port's TLS, from the same --tls-* files as the gRPC port."""
    if tls.cert is None or tls.key is None:
        raise ValueError("a TLS HTTP port needs --tls-cert and --tls-key")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert, tls.key)
    if require_client_auth:
        if tls.ca is None:
            raise ValueError("client certificates are verified only with --tls-ca")
        context.load_verify_locations(cafile=tls.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _half_the_file_limit() -> int:
    """Half the process's open-file limit, its soft value raised to the hard one first (as
    vLLM's server does): the common soft default of 1024 would cap the port at 512
    connections, fewer than load generators open, where the hard limit is often far above."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # an infinite hard limit is past what Linux allows
            pass
    return max(64, soft // 2) if soft != resource.RLIM_INFINITY else 1 << 16


class HttpServer:
    """One aiohttp application on host:port, started and drained with the gRPC server."""

    def __init__(self, app: web.Application, config: HttpConfig) -> None:
        self._app = app
        self.config = config
        self._runner: web.AppRunner | None = None
        self._port = 0
        self._is_tls = config.tls is not None

    @property
    def url(self) -> str:
        scheme = "https" if self._is_tls else "http"
        return f"{scheme}://{format_address(self.config.host, self._port)}"

    async def start(self) -> int:
        """Bind and serve; the port bound."""
        config = self.config
        context = None
        if config.tls is not None:
            context = ssl_context(config.tls, require_client_auth=config.require_client_auth)
        runner = web.AppRunner(
            self._app,
            handler_cancellation=True,  # the client went away: its request is cancelled
            shutdown_timeout=CLOSE_GRACE_S,  # after drain()'s wait for requests in flight
            access_log=None,  # the request's one log line is the frontend's own
            logger=_SERVER_LOG,
            # aiohttp's idle timer, which runs from the connection's start too (its default
            # is an hour: enough idle connections took every file of the process)
            keepalive_timeout=config.idle_timeout_s,
        )
        await runner.setup()
        # Port 0: one port picked first, as aiohttp gives each address of a host that resolves
        # to several (localhost: IPv4 and IPv6) a free port of its own, and sibling frontends
        # (reuse_port) join the one port the URL names.
        port = config.port or pick_free(config.host)
        limit = ConnectionLimit(config.max_connections or _half_the_file_limit())
        site = LimitedSite(
            runner, config.host, port, limit, ssl_context=context, reuse_port=config.reuse_port
        )
        await site.start()
        self._runner = runner
        addresses = runner.addresses  # (host, port, ...) per bound socket
        self._port = int(addresses[0][1]) if addresses else port
        _LOG.info("frontend: HTTP on %s", self.url)
        return self._port

    async def drain(self) -> None:
        """Refuse new work (503) while /health says 503, let requests in flight finish (up
        to drain_timeout_s), then close the port. Idempotent."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        gate = self._app.get(DRAIN_GATE)
        if gate is not None:
            gate.start_draining()
            timeout_s = self.config.drain_timeout_s
            try:
                is_idle = await gate.wait_idle(timeout_s)
            except asyncio.CancelledError:  # a second signal: cut what runs, then go
                gate.cut(second_signal("frontend"))
                await gate.wait_idle(CUT_WAIT_S)
                await runner.cleanup()
                raise
            if not is_idle:
                _LOG.warning(
                    "frontend: HTTP drain timed out with %s in flight: cut short (503)",
                    plural(gate.num_in_flight, "request"),
                )
                gate.cut(drain_ran_out("frontend", timeout_s))
                await gate.wait_idle(CUT_WAIT_S)  # their error events out, then the port
        await runner.cleanup()
