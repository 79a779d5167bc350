"""`mili serve`: tokenizer, prefill, decode and frontend as separate processes on this machine.

    mili serve [--model DIR] [--device cuda:0] [--prefill-instances 2] [--decode-instances 2]
               [--frontends 2]

Start-up: --port (and any fixed --*-port) is checked free first, so a taken port fails in a
second, not after loading models; then the demo model (or --model) is resolved once here and
passed to every child; the tokenizer, prefill and decode instances start together on free
ports (or --*-port), then the frontend with their addresses on --port (default 50051). Each
child announces its address on stdout and must then answer grpc.health.v1 SERVING (the
frontend: any answer, as it is NOT_SERVING while it has no usable tokenizer or prefill/decode
pair); one that exits first has its last log lines printed and `mili serve` exits non-zero.
--frontends N runs N frontend processes on one --port (and --http-port), bound with
SO_REUSEPORT, so the kernel spreads clients' connections over them; they share nothing but the
downstream services: one process's Python is the limit of the token rate it streams
(docs/benchmarks.md), so with --device cuda the default is one per 4 cores, at most 4 (on the
CPU, 1: the model is slower than one frontend). A client reaches several only over several
connections (each gRPC channel is one; `mili bench --connections`); one that dies is restarted
on the same port while the others keep serving it.
Children's logs go to stderr, each line prefixed with the child's name.

Supervision: once all are up, a child that exits is restarted on the same address (the
frontend's instance lists are fixed, so it finds the instance again where it left it) after a
backoff: 0.5 s, doubling per failure in a row up to 30 s, back to 0.5 s once a run stayed up
60 s. Its exit, its log lines since it last started (with the time of each) and its return are
printed. Meanwhile the others keep serving: the frontend routes around the missing instance,
and requests that were on it fail with UNAVAILABLE. --fail-fast instead stops everything and
exits 1 on the first exit.

One GPU, several engines: with --device cuda every prefill and decode process loads its own
model copy and sizes its own KV pool from device memory (mili.engine.kv_memory), each within
its share of --gpu-memory-utilization: --prefill-memory-share of it split evenly over the
prefill instances, the rest over the decode instances, whose KV pools are what concurrency
needs. E.g. 0.9 with share 0.2, one of each: prefill 0.18, decode 0.72 of the device.
--kv-cache-bytes/--num-blocks in --prefill-args/--decode-args still override.

Metrics: with --metrics-port BASE every child serves Prometheus metrics on --host: the frontend
on BASE, the tokenizer on BASE+1, prefill instance i on BASE+2+i, decode instance j on
BASE+2+P+j (P = --prefill-instances), frontend k >= 1 on BASE+1+P+D+k (D =
--decode-instances); BASE 0 gives each a free port. Each child announces
`<name> metrics on http://HOST:PORT/metrics` (forwarded to stderr), and the summary printed
once all are up lists every child's metrics URL.

TLS: --tls-cert/--tls-key/--tls-ca go to every child (mTLS between them, the frontend's public
port as its --public-tls says) and serve `mili serve`'s own health checks of them, which dial
each child's announced address: the certificate must name --host (an IP SAN for an address);
that, its dates and its CA are checked before any child starts.
--tls-demo instead makes a throwaway CA and a certificate per service in a temporary directory
(removed on exit): mTLS between the services, plain TLS on the frontend's port (clients need
only the CA), and prints the grpcurl and `mili generate` command lines that use it.

Shut-down (Ctrl-C or SIGTERM): the frontend drains first, so no new work reaches the rest;
then prefill and decode; the tokenizer last, since the frontend's last requests still
detokenize through it; exit 0. A second signal cuts every drain short, cancelling calls still
in flight, and `mili serve` exits 128 + the signal's number (130 for Ctrl-C). Children run in
their own session so a terminal's Ctrl-C reaches only us and the order holds; on Linux they also
die with us if we are killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Sequence
from typing import Any

from mili import flags
from mili.console import to_stderr, to_stdout
from mili.engine.engine_config import DEFAULT_GPU_MEMORY_UTILIZATION
from mili.errors import StartupError
from mili.plural import plural
from mili.serve import tls as serve_tls
from mili.serve.backoff import Backoff
from mili.serve.child import Child, describe_exit
from mili.serve.plan import (
    DEFAULT_HTTP_PORT,
    DEFAULT_PREFILL_MEMORY_SHARE,
    ENGINE,
    EVERY_CHILD,
    FRONTEND,
    Plan,
    check_ports,
    http_port,
    make_plan,
)

DEFAULT_PORT = 50051


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model_argument(parser)
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="frontend port (default: %(default)s)"
    )
    parser.add_argument(
        "--http-port",
        type=http_port,
        default=None,
        metavar="PORT|off",
        help="the frontend's HTTP API (OpenAI-compatible /v1/..., /generate, /status, /health); "
        f"every frontend's (--frontends); 0 = a free port; off = none (default: "
        f"{DEFAULT_HTTP_PORT}, a free port with --port 0)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        metavar="FRACTION",
        help="CUDA: fraction of the device's memory all prefill and decode processes together "
        "fill (weights, activations, CUDA graphs, KV pools) (default: %(default)s)",
    )
    parser.add_argument(
        "--prefill-memory-share",
        type=float,
        default=DEFAULT_PREFILL_MEMORY_SHARE,
        metavar="FRACTION",
        help="CUDA: the part of --gpu-memory-utilization the prefill instances get together; "
        "decode instances share the rest (default: %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="BASE",
        help="serve each child's Prometheus metrics: frontend on BASE, tokenizer BASE+1, "
        "prefill i BASE+2+i, decode j BASE+2+P+j; 0 = free ports (default: off)",
    )
    parser.add_argument(
        "--prefill-instances",
        type=int,
        default=1,
        metavar="N",
        help="prefill processes to run, each with its own model copy and KV pool (default: "
        "%(default)s)",
    )
    parser.add_argument(
        "--decode-instances",
        type=int,
        default=1,
        metavar="N",
        help="decode processes to run, each with its own model copy and KV pool; the frontend "
        "spreads requests over them (default: %(default)s)",
    )
    parser.add_argument(
        "--frontends",
        type=int,
        default=None,
        metavar="N",
        help="frontend processes to run, all on --port (and --http-port): the kernel spreads "
        "clients' connections over them (SO_REUSEPORT); they share only the downstream "
        "services (default: 1; with --device cuda one per 4 cores, at most 4: one "
        "frontend streams fewer tokens a second than a GPU decodes)",
    )
    parser.add_argument(
        "--fail-fast",
        action="store_true",
        help="a child that exits stops all the others and `mili serve` exits 1 (default: the "
        "child is restarted on the same port, with backoff, while the others keep serving)",
    )
    ports = parser.add_argument_group("internal ports (0 = any free port)")
    ports.add_argument("--tokenizer-port", type=int, default=0, help="(default: %(default)s)")
    ports.add_argument(
        "--prefill-port",
        type=int,
        default=0,
        help="first prefill port; instance i gets +i (default: %(default)s)",
    )
    ports.add_argument(
        "--decode-port",
        type=int,
        default=0,
        help="first decode port; instance i gets +i (default: %(default)s)",
    )
    extra = parser.add_argument_group(
        "extra flags for the children",
        "one quoted string each, e.g. --decode-args='--num-blocks 4096 --max-running 128'",
    )
    for kind in ("tokenizer", "prefill", "decode", "frontend"):
        extra.add_argument(f"--{kind}-args", default="", metavar="ARGS")
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds each child gets to load and answer health checks (default: %(default)s)",
    )
    for borrowed, title in (
        (EVERY_CHILD, "every child (as each service takes them)"),
        (ENGINE, "prefill and decode (as serve-prefill and serve-decode take them)"),
        (FRONTEND, "every frontend (as serve-frontend takes them)"),
    ):
        borrowed.declare(parser, title)
    serve_tls.add_arguments(parser)


def _say(message: str) -> None:
    to_stderr(f"mili serve: {message}\n")


class Launcher:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        tls = plan.health_tls
        self.tokenizer = Child("tokenizer", plan.tokenizer, tls=tls)
        self.prefills = [
            Child(f"prefill-{i}", argv, tls=tls) for i, argv in enumerate(plan.prefills)
        ]
        self.decodes = [Child(f"decode-{i}", argv, tls=tls) for i, argv in enumerate(plan.decodes)]
        self.frontends: list[Child] = []  # started once the rest is up
        self._stop = asyncio.Event()
        self._signals: list[int] = []
        self._failed = False  # --fail-fast: a child exited

    @property
    def children(self) -> list[Child]:
        rest = [self.tokenizer, *self.prefills, *self.decodes]
        return [*self.frontends, *rest]

    def _on_signal(self, signum: int) -> None:
        self._signals.append(signum)
        if len(self._signals) == 1:
            self._stop.set()
            name = signal.Signals(signum).name
            _say(f"got {name}: stopping frontend, then prefill/decode, then tokenizer")
        else:
            _say("got another signal: hurrying every drain (calls in flight are cut off)")
            for child in self.children:
                child.signal(signal.SIGTERM)  # a second SIGTERM skips the rest of a drain

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal, signum)
        code = 0
        try:
            if await self._start_all():
                code = await self._supervise()
        except StartupError as e:
            _say(f"error: {e}")
            code = 1
        finally:
            await self._stop_all()
        if len(self._signals) > 1:
            # The drains were cut short: whatever was in flight failed, which is no clean stop.
            _say("aborted: a second signal cut the drains short; calls in flight were cancelled")
            return 128 + self._signals[-1]
        return code

    async def _start_all(self) -> bool:
        """Everything up (True), or a signal came first (False); StartupError if a child failed."""
        backends = [self.tokenizer, *self.prefills, *self.decodes]
        if not await self._start(backends):
            return False
        downstream = [
            "--tokenizer",
            self._address(self.tokenizer),
            "--prefill",
            ",".join(self._address(c) for c in self.prefills),
            "--decode",
            ",".join(self._address(c) for c in self.decodes),
        ]
        many = len(self.plan.frontends) > 1
        frontends = [
            Child(
                f"frontend-{k}" if many else "frontend",
                [*argv, *downstream],
                tls=self.plan.frontend_health_tls,
            )
            for k, argv in enumerate(self.plan.frontends)
        ]
        # The first alone: the others share the ports it bound (--port 0 picks one)
        self.frontends = frontends[:1]
        if not await self._start(self.frontends):
            return False
        for child in frontends[1:]:
            child.share_ports(frontends[0])
        self.frontends = frontends
        if not await self._start(frontends[1:]):
            return False
        for child in [*backends, *self.frontends]:
            metrics = "" if child.metrics_url is None else f" metrics {child.metrics_url}"
            http = "" if child.http_url is None else f" http {child.http_url}"
            to_stdout(
                f"mili serve: {child.name:<10} {child.address} pid {child.pid}{http}{metrics}\n"
            )
        first = self.frontends[0]
        if first.http_url is not None:  # every frontend's: they share the port
            to_stdout(f"mili serve: OpenAI-compatible API on {first.http_url}/v1\n")
        if self.plan.tls_demo is not None:
            usage = serve_tls.demo_usage(self.plan.tls_demo, self._address(first), first.http_url)
            for line in usage:
                to_stdout(f"mili serve: {line}\n")
        # Last, in the form every service announces itself: scripts and tests read this line.
        to_stdout(f"frontend service listening on {first.address}\n")
        return True

    @staticmethod
    def _address(child: Child) -> str:
        assert child.address is not None
        return child.address

    async def _ready(self, child: Child) -> None:
        # The frontend's health follows its backends (NOT_SERVING while it has no usable
        # pair), so for it any answer means up.
        is_frontend = child in self.frontends
        status = await child.wait_ready(
            self.plan.startup_timeout_s, is_serving_required=not is_frontend
        )
        if status != "SERVING":
            _say(
                f"{child.name} is up but {status}: it has no usable tokenizer or prefill/decode "
                "pair yet (its log says why)"
            )

    async def _start(self, children: Sequence[Child]) -> bool:
        """Start `children` together and wait until all are ready (False: a signal came first)."""
        for child in children:
            await child.start()
        ready = asyncio.gather(*(self._ready(c) for c in children))
        return await self._unless_stopped(ready)

    async def _unless_stopped(self, work: asyncio.Future[Any]) -> bool:
        """Await `work` (True), or cancel it when a stop signal comes first (False)."""
        stop = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, StartupError):
                await work
            return False
        work.result()  # raises what went wrong
        return True

    async def _supervise(self) -> int:
        """Until a signal (0), or with --fail-fast a child's unexpected exit (1)."""
        watchers = [asyncio.create_task(self._watch(c)) for c in self.children]
        stop = asyncio.create_task(self._stop.wait())
        try:
            done, _ = await asyncio.wait({stop, *watchers}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in [stop, *watchers]:
                task.cancel()
            await asyncio.gather(stop, *watchers, return_exceptions=True)
        for task in done:
            error = None if task is stop or task.cancelled() else task.exception()
            if error is not None:
                raise error  # a bug in watching: stop everything rather than watch no more
        return 1 if self._failed else 0

    async def _watch(self, child: Child) -> None:
        """Restart `child` whenever it exits (with backoff); return only under --fail-fast."""
        backoff = Backoff()
        while True:
            pid = child.pid
            code = await child.wait_exit()
            up_s = child.up_s
            if child.ready_at is None:
                when = f"{child.run_s:.1f} s after starting, before it was ready"
            else:
                when = f"after {up_s:.1f} s up"
            what = f"{child.name} (pid {pid}) {describe_exit(code)} {when}"
            last = plural(len(child.tail), "log line")
            lines = f"its last {last} since it started:\n{child.tail.format()}"
            if self.plan.fail_fast:
                _say(f"{what}; {lines}")
                _say("stopping the others (--fail-fast)")
                self._failed = True
                return
            delay_s = backoff.next_delay(up_s)
            _say(
                f"{what}; restarting it on {child.address} in {delay_s:.1f} s (restart "
                f"{backoff.num_failures} in a row; the others keep serving); {lines}"
            )
            await asyncio.sleep(delay_s)  # cancelled by a stop signal
            await child.start()
            try:
                await self._ready(child)
            except StartupError as e:
                if child.returncode is None:  # alive but stuck: the next turn reports its exit
                    _say(f"{str(e).partition(';')[0]}; killing it")
                    child.signal(signal.SIGKILL)
                continue
            _say(f"{child.name} is back on {child.address} (pid {child.pid})")

    async def _stop_all(self) -> None:
        grace_s = self.plan.drain_timeout_s + 15.0  # the child's drain, grpc grace, start-up
        stages = [
            self.frontends,
            [*self.prefills, *self.decodes],
            [self.tokenizer],
        ]
        for stage in stages:
            running = [c for c in stage if c.proc is not None and c.returncode is None]
            codes = await asyncio.gather(*(c.stop(grace_s, _say) for c in running))
            for child, code in zip(running, codes, strict=True):
                # -SIGTERM: stopped while still loading, before it handles signals; -SIGKILL
                # was announced when sent.
                if code not in (0, None, -signal.SIGTERM, -signal.SIGKILL):
                    _say(f"{child.name} {describe_exit(code)}")


def run(args: argparse.Namespace) -> int:
    flags.setup_logging(args)
    check_ports(args)
    model_dir = flags.resolve_model(args)  # the demo model is built here once, not per child
    if not model_dir.is_dir():
        why = "is not a directory" if model_dir.exists() else "does not exist"
        raise StartupError(f"model directory {model_dir} {why}")
    with serve_tls.demo_certificates(args, _say) as demo:
        plan = make_plan(args, model_dir, demo)

        async def main() -> int:
            return await Launcher(plan).run()

        return asyncio.run(main())
