"""One service process of `mili serve`: start it, forward its output, know when it is ready.

A child announces `<name> service listening on HOST:PORT` on stdout (and `<name> metrics on URL`
with a metrics port, `<name> http on URL` with an HTTP port). The first address it announces is
kept: every restart passes the same `--port` (and `--metrics-port`, `--http-port`), because
the frontend's instance lists are fixed at its start and a restarted instance must come back
where the frontend polls for it (and clients where they found it). Servers bind with
SO_REUSEADDR, so the connections a killed child leaves in TIME_WAIT do not hold the port.

Each run's output lines are kept in a small ring with the time each arrived, cleared at every
start: what is printed when the child dies is what *this* run said, never a traceback left by
an earlier one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from mili.console import to_stderr
from mili.errors import StartupError

if TYPE_CHECKING:
    from mili.rpc.tls import Tls

_LISTENING = re.compile(r"(\w+) service listening on (\S+)")
_METRICS = re.compile(r"(\w+) metrics on (\S+)")
_HTTP = re.compile(r"(\w+) http on (\S+)")
_ROOT = Path(__file__).resolve().parent.parent  # holds the `mili` and `services` packages
# The longest line read from a child at once; a longer one is cut (its rest forwarded after).
_LINE_LIMIT = 1 << 20
TAIL_LINES = 40


def die_with_parent() -> None:
    """A Popen `preexec_fn` (Linux; runs in the child between fork and exec): the child gets
    SIGTERM when the thread that started it dies, however it dies (SIGKILL included)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def describe_exit(code: int | None) -> str:
    """`exited with code 1`, `exited with code -9 (SIGKILL)`."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"exited with code {code} ({signal.Signals(-code).name})"
    return f"exited with code {code}"


class LogTail:
    """The last `max_lines` lines of one run of a child, each with the wall time it arrived."""

    def __init__(self, max_lines: int = TAIL_LINES) -> None:
        self._lines: deque[tuple[float, str]] = deque(maxlen=max_lines)

    def append(self, line: str) -> None:
        self._lines.append((time.time(), line))

    def clear(self) -> None:
        self._lines.clear()

    def __len__(self) -> int:
        return len(self._lines)

    def format(self, indent: str = "    ") -> str:
        if not self._lines:
            return f"{indent}(no output)"
        return "\n".join(f"{indent}{_clock(at)} {line}" for at, line in self._lines)


def _clock(at: float) -> str:
    return datetime.fromtimestamp(at).strftime("%H:%M:%S.%f")[:-3]


class Child:
    """One service process, started (and restarted) as `python -m mili ARGV...`."""

    def __init__(self, name: str, argv: list[str], *, tls: Tls | None = None) -> None:
        """`tls`: what the health checks dial it with (None: plaintext), as its flags say."""
        self.name = name  # "tokenizer", "prefill-0", ...
        self.argv = argv
        self.tls = tls
        self.proc: asyncio.subprocess.Process | None = None
        self.address: str | None = None  # where it listens: set by its first run, then pinned
        self.metrics_url: str | None = None  # likewise, when it serves metrics
        self.http_url: str | None = None  # likewise, a frontend's HTTP API
        self.tail = LogTail()
        self.started_at = 0.0  # time.monotonic() of the current run's start
        self.ready_at: float | None = None  # ... and of it answering health, None until then
        self._run_address: str | None = None  # what the current run announced
        self._announced = asyncio.Event()
        self._readers: list[asyncio.Task[None]] = []

    def command(self) -> list[str]:
        """Its argv, with the port (and metrics port) of its first run pinned once known.

        Appended last, so they win over the same flags earlier in argv (argparse keeps the last).
        """
        pins: list[str] = []
        if self.address is not None:
            pins += ["--port", self.address.rpartition(":")[2]]
        if self.metrics_url is not None and (port := urlsplit(self.metrics_url).port):
            pins += ["--metrics-port", str(port)]
        if self.http_url is not None and (port := urlsplit(self.http_url).port):
            pins += ["--http-port", str(port)]
        return [*self.argv, *pins]

    def share_ports(self, other: Child) -> None:
        """Listen where `other` (up) does, --port and --http-port: sibling frontends, sharing
        them with SO_REUSEPORT (its --port 0 picked the port). A health check of the shared
        port may then be answered by a sibling: what says this one bound it is its own
        announcement, which `wait_ready` waits for first."""
        self.address, self.http_url = other.address, other.http_url

    async def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
        self.tail.clear()
        self._run_address = None
        self._announced = asyncio.Event()
        self.ready_at = None
        self.started_at = time.monotonic()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "mili",
            *self.command(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent if sys.platform == "linux" else None,
            limit=_LINE_LIMIT,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._readers = [
            asyncio.create_task(self._forward(self.proc.stdout, self._on_stdout)),
            asyncio.create_task(self._forward(self.proc.stderr, None)),
        ]

    def _on_stdout(self, line: str) -> None:
        metrics = _METRICS.search(line)
        if metrics and self.metrics_url is None:
            self.metrics_url = metrics.group(2)
        http = _HTTP.search(line)
        if http and self.http_url is None:
            self.http_url = http.group(2)
        match = _LISTENING.search(line)
        if match and self._run_address is None:
            self._run_address = match.group(2)
            self._announced.set()

    async def _forward(
        self, stream: asyncio.StreamReader, on_line: Callable[[str], None] | None
    ) -> None:
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line over the pipe's limit: asyncio dropped what it held
                raw = f"[mili serve: a line of over {_LINE_LIMIT} bytes was cut here]\n".encode()
            if not raw:
                return
            line = raw.decode(errors="replace").rstrip("\n")
            self.tail.append(line)
            to_stderr(f"[{self.name}] {line}\n")
            if on_line is not None:
                on_line(line)

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def run_s(self) -> float:
        """How long ago the current run started."""
        return time.monotonic() - self.started_at

    @property
    def up_s(self) -> float:
        """How long the current run has been ready (0 if it never was)."""
        return 0.0 if self.ready_at is None else time.monotonic() - self.ready_at

    async def wait_exit(self) -> int:
        """Wait until the current run exits and its last lines are read; its exit code."""
        assert self.proc is not None
        code = await self.proc.wait()
        await self._drain_readers()
        return code

    async def _drain_readers(self) -> None:
        """Wait for the readers to reach the pipes' end. A grandchild holding the pipes open
        must not hold us: 2 s, then they are cancelled. A cancel of the task that waits here
        (a stopped watcher) goes through and leaves them reading (shielded: `stop` waits for
        them again, and a reader cancelled along with it raised CancelledError there)."""
        readers = asyncio.gather(*self._readers, return_exceptions=True)
        try:
            async with asyncio.timeout(2.0):
                await asyncio.shield(readers)
        except TimeoutError:
            readers.cancel()

    async def wait_ready(self, timeout_s: float, *, is_serving_required: bool = True) -> str:
        """Wait until it announced its address and answers health; StartupError if it died or
        took longer than `timeout_s` to announce. Returns the health status it answered.

        `is_serving_required=False` accepts NOT_SERVING too: the frontend's health follows
        its backends, and it is up even while they are not.
        """
        assert self.proc is not None
        announced = asyncio.create_task(self._announced.wait())
        exited = asyncio.create_task(self.proc.wait())
        try:
            await asyncio.wait(
                {announced, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            announced.cancel()
            exited.cancel()
        if self._run_address is None:
            await self._drain_readers()
            if self.proc.returncode is None:
                raise StartupError(self.failure(f"did not start within {timeout_s:.0f} s"))
            raise StartupError(self.failure(describe_exit(self.proc.returncode)))
        if self.address is None:
            self.address = self._run_address
        elif self._run_address != self.address:  # --port pinned it: only a bug gets here
            raise StartupError(
                self.failure(f"came back on {self._run_address}, not on {self.address}")
            )
        accepted = ("SERVING",) if is_serving_required else ("SERVING", "NOT_SERVING")
        status = await _wait_for_health(self.address, accepted, min(timeout_s, 60.0), self.tls)
        if status not in accepted:
            what = f"was not {' or '.join(accepted)} within {min(timeout_s, 60.0):.0f} s"
            raise StartupError(self.failure(f"{what} (last health check: {status})"))
        self.ready_at = time.monotonic()
        return status

    def failure(self, what: str) -> str:
        return f"{self.name} {what} during start-up; its last log lines:\n{self.tail.format()}"

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signum)

    async def stop(self, timeout_s: float, say: Callable[[str], None]) -> int | None:
        """SIGTERM (drain), then SIGKILL after `timeout_s`; returns the exit code."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout_s):
                await self.proc.wait()
        except TimeoutError:
            say(f"{self.name} did not stop within {timeout_s:.0f} s; killing it")
            self.signal(signal.SIGKILL)
            await self.proc.wait()
        await self._drain_readers()
        return self.proc.returncode


async def _wait_for_health(
    address: str, accepted: tuple[str, ...], timeout_s: float, tls: Tls | None = None
) -> str:
    """Poll grpc.health.v1 Check ("" = the whole server) until its status is in `accepted`;
    returns that status, or the last one seen (an error's code name and grpc's details, with a
    hint when it looks like TLS) after `timeout_s`. `tls`: dial with it, verifying the
    address's host."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mili.rpc.client import brief_details, connection_hint
    from mili.rpc.client import channel as open_channel

    channel = open_channel(address, tls=tls)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    delay_s = 0.02
    last = "no answer"
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=min(left, 1.0))
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as err:
                hint = connection_hint(err, is_tls=tls is not None)
                brief = brief_details(err)
                last = f"{err.code().name}{': ' + brief if brief else ''}{hint}"
            if last in accepted:
                return last
            await asyncio.sleep(min(delay_s, max(0.0, deadline - time.monotonic())))
            delay_s = min(delay_s * 2, 0.5)
    finally:
        await channel.close()
    return last
