"""The grpc.aio server every MILI service runs: health, reflection, error mapping, graceful drain.

Life of a server:

    RpcServer(config, name="tokenizer")
      .add_service("mili.tokenizer.v1.TokenizerService", lambda s: add_..._to_server(servicer, s),
                   policy)   each method's request size limit and callers (mili.rpc.policy)
      .start()          bind, start; health SERVING for "" and every added service
      .set_serving(b)   optional: SERVING / NOT_SERVING while running, for a service that is
                        useless without others (the frontend with no backend up)
      ... SIGTERM ...
      .drain()          health NOT_SERVING; new application calls -> UNAVAILABLE ("draining");
                        wait for in-flight calls (at most drain_timeout_s); then stop(grace_s).
                        Health and reflection keep answering until that final stop, so a load
                        balancer (or a test) sees NOT_SERVING rather than a closed port.

A service's `__main__` builds the config from its CLI flags and calls `serve_forever(server)`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from mili.console import to_stdout
from mili.cut import CUT_WAIT_S, drain_ran_out, second_signal
from mili.discovery import format_address
from mili.errors import StartupError
from mili.plural import plural
from mili.rpc.interceptor import CallInterceptor
from mili.rpc.policy import OPEN, SMALL_REQUEST_BYTES, Policy
from mili.rpc.server_config import ServerConfig
from mili.telemetry.metrics import (
    MetricsServer,
    RequestMetrics,
    watch_process,
)

_LOG = logging.getLogger("mili.rpc")
# grpc's backlog of calls not yet picked up by the application (see RpcServer.start): above
# the frontend's default of 4096 running requests and their queue.
_MAX_PENDING_CALLS = 16_384

Register = Callable[[grpc.aio.Server], None]

# The service name that a --health-port server reports SERVING from start to stop, drains
# included: a liveness probe on it restarts a process that hangs, never one that drains.
LIVENESS = "liveness"


class RpcServer:
    """One service's grpc.aio server. Not reusable: start once, drain once."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        name: str,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.name = name
        # The process's metrics (process_*, the calls counted by the interceptor; the service's
        # own are added by its entry point); served on config.metrics_port from `start` until
        # the server stopped.
        self.registry = CollectorRegistry() if registry is None else registry
        watch_process(self.registry)
        self._metrics_server: MetricsServer | None = None
        # Run before our own (tracing): their spans then see the status our interceptor sets.
        self._outer_interceptors = list(interceptors)
        self._registrations: list[tuple[str, Register, Policy]] = []
        # Calls by method and status; a servicer that carries many requests on one call (decode's
        # GenerateStream) counts each of them here as the call it stands for.
        self.request_metrics = RequestMetrics(self.registry)
        self._interceptor = CallInterceptor(name, self.request_metrics)
        self._health = health.aio.HealthServicer()
        # The --health-port server's own: its LIVENESS entry survives the drain.
        self._probe_health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._probe_server: grpc.aio.Server | None = None
        self._port = 0
        self._health_port = 0
        self._drain_task: asyncio.Task[None] | None = None
        self._hurry: asyncio.Event | None = None  # set by a second signal: skip the drain wait
        self._stopped: asyncio.Event | None = None
        self._is_serving = True  # what health reports until drained; see set_serving
        self._drain_hooks: list[Callable[[], Coroutine[Any, Any, None]]] = []

    def add_drain_hook(self, hook: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Drain something else beside this server (the frontend's HTTP port): `hook` starts
        with the drain and is awaited before the server counts as stopped; a second signal
        cancels it."""
        self._drain_hooks.append(hook)

    def add_service(self, full_name: str, register: Register, policy: Policy = OPEN) -> None:
        """Register one service before `start`; `full_name` is its proto name (for health,
        reflection and logs), `register` adds its servicer to the grpc server, `policy` says how
        large each method's requests may be and who may call it (default: anyone, up to the
        server's receive limit)."""
        if self._server is not None:
            raise RuntimeError(f"{self.name}: add_service({full_name!r}) after start()")
        if any(name == full_name for name, _, _ in self._registrations):
            raise ValueError(f"{self.name}: service {full_name!r} added twice")
        self._registrations.append((full_name, register, policy))

    @property
    def service_names(self) -> list[str]:
        return [name for name, _, _ in self._registrations]

    @property
    def receive_limit(self) -> int:
        """What grpc is told to receive: the largest request of any method, within the config's
        limit (health and reflection requests are small)."""
        limit = self.config.receive_limit
        largest = [policy.largest(limit) for _, _, policy in self._registrations]
        return max([min(SMALL_REQUEST_BYTES, limit), *largest])

    @property
    def port(self) -> int:
        """The bound port (useful when the config asked for port 0); 0 before `start`."""
        return self._port

    @property
    def address(self) -> str:
        return format_address(self.config.host, self._port)

    @property
    def health_address(self) -> str | None:
        """HOST:PORT of the plaintext health-only server, once started with a health_port."""
        if self._probe_server is None:
            return None
        return format_address(self.config.host, self._health_port)

    @property
    def metrics_url(self) -> str | None:
        """http://HOST:PORT/metrics once started with a metrics_port, else None."""
        return None if self._metrics_server is None else self._metrics_server.url

    @property
    def num_in_flight(self) -> int:
        """Application calls (not health/reflection) whose handlers are running."""
        return self._interceptor.num_in_flight

    @property
    def is_draining(self) -> bool:
        return self._interceptor.is_draining

    async def start(self) -> int:
        """Bind, start serving, mark every service SERVING; return the bound port."""
        if self._server is not None:
            raise RuntimeError(f"{self.name}: start() called twice")
        window: list[tuple[str, int]] = []
        if self.config.receive_window_bytes is not None:
            window = [
                ("grpc.http2.bdp_probe", 0),
                ("grpc.http2.lookahead_bytes", self.config.receive_window_bytes),
            ]
        server = grpc.aio.server(
            interceptors=[*self._outer_interceptors, self._interceptor],
            options=[
                *window,
                ("grpc.max_send_message_length", self.config.max_message_bytes),
                ("grpc.max_receive_message_length", self.receive_limit),
                ("grpc.so_reuseport", int(self.config.reuse_port)),
                # Ping idle clients so calls from vanished peers end (and free their blocks) ...
                ("grpc.keepalive_time_ms", 60_000),
                ("grpc.keepalive_timeout_ms", 20_000),
                # ... and accept our clients' 30 s keepalive pings (the default floor of 5 min
                # would answer them with GOAWAY "too_many_pings" on long, quiet streams).
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                # Calls the Python loop has not picked up yet: past grpc's default of 1000 a
                # burst (an HTTP request with n=128 choices is 128 Tokenize calls) is cut with
                # a bare CANCELLED before our admission could answer RESOURCE_EXHAUSTED with a
                # retry hint. Our own limits bound what runs; these bound only the backlog.
                ("grpc.server.max_pending_requests", _MAX_PENDING_CALLS),
                ("grpc.server.max_pending_requests_hard_limit", 2 * _MAX_PENDING_CALLS),
            ],
        )
        self._server = server
        self._hurry = asyncio.Event()
        self._stopped = asyncio.Event()
        self._interceptor.set_policies(
            {name: policy for name, _, policy in self._registrations}, self.receive_limit
        )
        for _, register, _ in self._registrations:
            register(server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        address = format_address(self.config.host, self.config.port)
        tls = self.config.tls
        try:
            if tls is None:
                self._port = server.add_insecure_port(address)
            else:
                credentials = tls.tls.server_credentials(
                    require_client_auth=tls.require_client_auth
                )
                self._port = server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            raise StartupError(f"{self.name}: cannot listen on {address}; is it in use?") from exc
        if self.config.health_port is not None:
            await self._start_probe_server()
        if self.config.metrics_port is not None:
            try:
                self._metrics_server = MetricsServer(
                    self.registry, self.config.host, self.config.metrics_port
                )
            except OSError as exc:
                where = format_address(self.config.host, self.config.metrics_port)
                raise StartupError(f"{self.name}: cannot serve metrics on {where}: {exc}") from exc
        await server.start()
        await self._set_health()
        security = "plaintext"
        if tls is not None:
            security = "mTLS" if tls.require_client_auth else "TLS"
        _LOG.info(
            "%s listening on %s (%s) serving %s",
            self.name,
            self.address,
            security,
            ", ".join(self.service_names),
        )
        return self._port

    async def _start_probe_server(self) -> None:
        assert self.config.health_port is not None
        probe = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self._probe_health, probe)
        address = format_address(self.config.host, self.config.health_port)
        try:
            self._health_port = probe.add_insecure_port(address)
        except RuntimeError as exc:
            raise StartupError(f"{self.name}: cannot serve health on {address}") from exc
        await self._probe_health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await probe.start()
        self._probe_server = probe

    async def set_serving(self, is_serving: bool) -> None:
        """Report the server (and each of its services) SERVING or NOT_SERVING in
        grpc.health.v1, so a load balancer routes away while it cannot do useful work.

        Callable before `start` (which then starts with it). A drain wins: once draining,
        health stays NOT_SERVING whatever this is told.
        """
        self._is_serving = is_serving
        if self._server is not None:
            await self._set_health()

    async def drain(self) -> None:
        """Stop taking calls, let in-flight ones finish (up to drain_timeout_s), then stop.

        Idempotent and safe to call concurrently: every caller returns once the server stopped.
        """
        if self._server is None:
            raise RuntimeError(f"{self.name}: drain() before start()")
        # shield: a caller that gives up waiting must not cancel the drain itself.
        await asyncio.shield(self._start_drain())

    async def wait(self) -> None:
        """Return once the server has stopped (after `drain`)."""
        if self._stopped is None:
            raise RuntimeError(f"{self.name}: wait() before start()")
        await self._stopped.wait()

    async def run_until_signal(self, ready: Callable[[], None] = lambda: None) -> None:
        """Drain on SIGTERM or SIGINT; a second signal skips the rest of the drain wait.

        `ready` runs once the signals are handled (serve_forever announces the address there:
        a launcher that reads it may send SIGTERM at once). Returns once stopped. Must run in
        the main thread (asyncio signal handlers).
        """
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT)
        for signum in signals:
            loop.add_signal_handler(signum, self._on_signal, signum)
        try:
            ready()
            await self.wait()
            if self._drain_task is not None:
                await self._drain_task  # re-raise whatever went wrong while draining
        finally:
            for signum in signals:
                loop.remove_signal_handler(signum)

    # ---- internals ---------------------------------------------------------------------------

    async def _set_health(self) -> None:
        if self.is_draining:  # grpc's servicer also ignores set() after a graceful shutdown
            return
        status = health_pb2.HealthCheckResponse.NOT_SERVING
        if self._is_serving:
            status = health_pb2.HealthCheckResponse.SERVING
        for name in ["", *self.service_names]:
            await self._health.set(name, status)
            await self._probe_health.set(name, status)

    async def _await_hooks(self, hooks: list[asyncio.Task[None]]) -> None:
        """The drain hooks' ends; a second signal cancels those still running."""
        assert self._hurry is not None
        hurry: asyncio.Task[Any] = asyncio.create_task(self._hurry.wait())
        try:
            pending: set[asyncio.Task[Any]] = set(hooks)
            while pending and not self._hurry.is_set():
                _, pending = await asyncio.wait({*pending, hurry}, return_when="FIRST_COMPLETED")
                pending.discard(hurry)
            for task in pending:
                task.cancel()
            results = await asyncio.gather(*hooks, return_exceptions=True)
        finally:
            hurry.cancel()
        for result in results:
            if isinstance(result, Exception):
                _LOG.error("%s: a drain hook failed: %s", self.name, result, exc_info=result)

    def _start_drain(self) -> asyncio.Task[None]:
        if self._drain_task is None:
            assert self._server is not None
            self._drain_task = asyncio.create_task(self._drain(self._server))
        return self._drain_task

    def _on_signal(self, signum: int) -> None:
        signame = signal.Signals(signum).name
        if self._drain_task is None:
            _LOG.info("%s: got %s, draining", self.name, signame)
            self._start_drain()
        else:
            _LOG.warning("%s: got %s again, skipping the rest of the drain", self.name, signame)
            assert self._hurry is not None
            self._hurry.set()

    async def _drain(self, server: grpc.aio.Server) -> None:
        assert self._hurry is not None and self._stopped is not None
        started = time.monotonic()
        self._interceptor.start_draining()
        await self._health.enter_graceful_shutdown()
        for name in ["", *self.service_names]:  # not LIVENESS: draining is not hanging
            await self._probe_health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        timeout_s = self.config.drain_timeout_s
        _LOG.info(
            "%s: draining; %s in flight, waiting up to %.1f s",
            self.name,
            plural(self.num_in_flight, "call"),
            timeout_s,
        )
        hooks = [asyncio.create_task(hook()) for hook in self._drain_hooks]
        idle = asyncio.create_task(self._interceptor.wait_idle())
        hurry = asyncio.create_task(self._hurry.wait())
        first = asyncio.FIRST_COMPLETED
        try:
            await asyncio.wait({idle, hurry}, timeout=timeout_s, return_when=first)
        finally:
            idle.cancel()
            hurry.cancel()
        grace_s = 0.0 if self._hurry.is_set() else self.config.grace_s
        left = self.num_in_flight
        _LOG.log(
            logging.WARNING if left else logging.INFO,
            "%s: drained in %.2f s; %s still in flight%s, stopping with %.1f s grace",
            self.name,
            time.monotonic() - started,
            plural(left, "gRPC call"),
            ", cut short (UNAVAILABLE)" if left else "",
            grace_s,
        )
        if left:
            await self._cut(timeout_s)
        try:
            await server.stop(grace_s)
            if self._probe_server is not None:
                await self._probe_server.stop(0)
            if hooks:
                await self._await_hooks(hooks)
        finally:
            if self._metrics_server is not None:  # scrapes kept answering through the drain
                self._metrics_server.close()
            self._stopped.set()
            _LOG.info("%s: stopped", self.name)

    async def _cut(self, timeout_s: float) -> None:
        """End the calls still in flight UNAVAILABLE, saying why (mili.cut), and give them up
        to CUT_WAIT_S to send it: grpc's own stop would end them CANCELLED or UNAVAILABLE
        with nothing said, and their log lines would blame their callers."""
        assert self._hurry is not None
        if self._hurry.is_set():
            why = second_signal(self.name)
        else:
            why = drain_ran_out(self.name, timeout_s)
        self._interceptor.cut(why)
        try:
            async with asyncio.timeout(CUT_WAIT_S):
                await self._interceptor.wait_idle()
        except TimeoutError:
            pass  # grpc's stop ends what is left


async def serve_forever(server: RpcServer) -> None:
    """Start `server`, print `<name> service listening on HOST:PORT`, serve until a signal.

    With a metrics_port, `<name> metrics on http://HOST:PORT/metrics` is printed first.

    For a service's `__main__`: `asyncio.run(serve_forever(server))` returns after a SIGTERM
    or SIGINT drain, so the process exits 0.
    """
    await server.start()

    def ready() -> None:
        # flushed: tests and launchers read the port from these lines
        if server.metrics_url is not None:
            to_stdout(f"{server.name} metrics on {server.metrics_url}\n")
        if server.health_address is not None:
            to_stdout(f"{server.name} health on {server.health_address}\n")
        to_stdout(f"{server.name} service listening on {server.address}\n")

    await server.run_until_signal(ready)


def drain_on_death(name: str) -> Callable[[BaseException], None]:
    """For a service's engine thread (prefill's worker, decode's batch loop): when a bug kills
    it, the instance can do no useful work, yet would keep admitting requests to fail them.
    Called on that thread: logs it and drains this process as SIGTERM does (new calls go to
    other instances); its __main__ then exits 1, and mili serve or Kubernetes starts a fresh
    one."""

    def on_death(error: BaseException) -> None:
        _LOG.critical("%s: its engine thread died (%r): stopping this instance", name, error)
        os.kill(os.getpid(), signal.SIGTERM)

    return on_death
