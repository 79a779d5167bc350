"""What `mili serve` starts: every child's command line, built once from the flags (`make_plan`),
and the fixed ports checked free before any model loads (`check_ports`). Pure argv arithmetic,
no process is started here; the port, metrics-port and GPU-memory layouts it encodes are
described in mili.serve.launcher's docstring, which starts and supervises the children."""

from __future__ import annotations

import argparse
import functools
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mili import flags, ports
from mili.discovery import format_address
from mili.engine.engine_config import add_engine_arguments
from mili.errors import StartupError
from mili.rpc.tls import Tls
from mili.serve import tls as serve_tls
from mili.serve.forwarded_flags import Borrowed
from services.frontend import __main__ as frontend_main

if TYPE_CHECKING:
    from mili.rpc.certs import CertFiles  # cryptography: imported only for --tls-demo

# The children's own flags `mili serve` takes and hands on (mili.serve.forwarded_flags).
EVERY_CHILD = Borrowed(
    functools.partial(flags.add_server_arguments, default_port=0),
    ("--host", "--log-level", "--drain-timeout", "--otlp-endpoint", "--trace-console"),
    keep_defaults=True,
)
ENGINE = Borrowed(
    functools.partial(add_engine_arguments, default_pool="the service's default"),
    ("--device", "--dtype", "--attention", "--no-prefix-cache", "--watchdog-timeout"),
)
FRONTEND = Borrowed(
    frontend_main.add_arguments,
    (
        "--served-model-name",
        "--sampling-defaults",
        "--hung-after",
        "--default-max-tokens",
        "--max-buffered-tokens",
        "--stream-interval",
        "--max-queued-requests",
        "--max-queued-tokens",
        "--max-concurrent-requests",
        "--public-tls",
    ),
)

# Prefill's pool holds only the prompts in flight (its queue bound); decode's holds every running
# request's whole context, so decode gets most of a shared GPU.
DEFAULT_PREFILL_MEMORY_SHARE = 0.2


@dataclass(frozen=True)
class Plan:
    """What to start: built once from the flags."""

    tokenizer: list[str]
    prefills: list[list[str]]
    decodes: list[list[str]]
    frontends: list[list[str]]  # without the instance addresses, known only once they are up
    startup_timeout_s: float
    drain_timeout_s: float
    fail_fast: bool = False  # a child that exits stops everything (exit 1) instead of restarting
    health_tls: Tls | None = None  # what our health checks of the children dial with
    frontend_health_tls: Tls | None = None  # the frontends': none with --public-tls off
    tls_demo: CertFiles | None = None  # --tls-demo: the files a client outside uses

    @property
    def frontend(self) -> list[str]:
        """The first frontend's argv."""
        return self.frontends[0]


DEFAULT_HTTP_PORT = 8000
HTTP_OFF = -1  # --http-port off


def http_port(text: str) -> int:
    """--http-port's value: a port, or `off` (HTTP_OFF)."""
    if text == "off":
        return HTTP_OFF
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(text)
    return port


def frontend_http_port(args: argparse.Namespace) -> int | None:
    """The frontends' HTTP port (0: a free one), None when off: --http-port, else 8000, else
    (with --port 0, every port picked free) 0."""
    if args.http_port is None:
        return 0 if args.port == 0 else DEFAULT_HTTP_PORT
    return None if args.http_port == HTTP_OFF else int(args.http_port)


def _http(port: int | None) -> list[str]:
    return [] if port is None else ["--http-port", str(port)]


def _port(base: int, i: int) -> str:
    return str(_offset(base, i))


def _metrics(base: int | None, offset: int) -> list[str]:
    """A child's --metrics-port flag: BASE+offset, 0 for every child when BASE is 0."""
    return [] if base is None else ["--metrics-port", _port(base, offset)]


def memory_shares(
    utilization: float, prefill_share: float, num_prefills: int, num_decodes: int
) -> tuple[float, float]:
    """--gpu-memory-utilization of one prefill and of one decode process on a shared GPU."""
    if not 0 < utilization <= 1:
        raise StartupError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    if not 0 < prefill_share < 1:
        raise StartupError(f"--prefill-memory-share must be in (0, 1), got {prefill_share}")
    return (
        utilization * prefill_share / num_prefills,
        utilization * (1 - prefill_share) / num_decodes,
    )


# Flags of a child that mili serve sets from its own and that other children rely on: its
# address (the others are told it before it starts), the addresses it calls, and its drain
# timeout (mili serve waits that long, plus a margin, before it kills it).
_WIRED: dict[str, tuple[str, ...]] = {
    "tokenizer": ("--host", "--port", "--drain-timeout"),
    "prefill": ("--host", "--port", "--decode", "--drain-timeout"),
    "decode": ("--host", "--port", "--drain-timeout"),
    "frontend": (
        "--host",
        "--port",
        "--tokenizer",
        "--prefill",
        "--decode",
        "--drain-timeout",
        "--public-tls",  # mili serve checks the frontend's health the way it says
    ),
}


MAX_DEFAULT_FRONTENDS = 4


def num_frontends(args: argparse.Namespace, num_cores: int | None = None) -> int:
    """--frontends, else 1 on the CPU and, with --device cuda, one per 4 of this machine's
    cores (`num_cores`, default: those this process may run on), 1 to MAX_DEFAULT_FRONTENDS.
    One frontend's Python streams fewer tokens a second than a GPU decodes at saturation (a
    message per token and client; docs/benchmarks.md, "mili bench's own CPU, and several
    frontends by default on CUDA"), while a CPU's decode is slower than one frontend."""
    if args.frontends is not None:
        return int(args.frontends)
    if args.device is None or not args.device.startswith("cuda"):
        return 1
    if num_cores is None:
        num_cores = len(os.sched_getaffinity(0))
    return max(1, min(MAX_DEFAULT_FRONTENDS, num_cores // 4))


def make_plan(
    args: argparse.Namespace, model_dir: Path, demo: dict[str, CertFiles] | None = None
) -> Plan:
    """`demo`: --tls-demo's files (mili.rpc.certs.write_demo)."""
    tls = serve_tls.tls_plan(args, demo)
    frontends = num_frontends(args)
    if args.prefill_instances < 1 or args.decode_instances < 1 or frontends < 1:
        raise StartupError("--prefill-instances, --decode-instances and --frontends must be >= 1")
    if not 0 < args.startup_timeout < float("inf"):  # (0, NaN, inf: a wait that never ends well)
        raise StartupError(
            f"--startup-timeout must be a number of seconds > 0, got {args.startup_timeout}"
        )
    if not 0 <= args.drain_timeout < float("inf"):  # refused here, not by each child in turn
        raise StartupError(
            f"--drain-timeout must be a number of seconds >= 0, got {args.drain_timeout}"
        )
    metrics_base: int | None = args.metrics_port
    first_decode = 2 + args.prefill_instances  # metrics port offsets, see the module docstring
    after_decodes = first_decode + args.decode_instances  # frontend k >= 1: after_decodes+k-1
    common = EVERY_CHILD.argv(args)
    model = ["--model", str(model_dir)]
    engine = ENGINE.argv(args)
    streaming = FRONTEND.argv(args)

    prefill_memory, decode_memory = memory_shares(
        args.gpu_memory_utilization,
        args.prefill_memory_share,
        args.prefill_instances,
        args.decode_instances,
    )
    is_cuda = args.device is not None and args.device.startswith("cuda")

    def memory(fraction: float) -> list[str]:
        return ["--gpu-memory-utilization", f"{fraction:.4f}"] if is_cuda else []

    def extra(kind: str) -> list[str]:
        # TLS first: a flag in --KIND-args comes later and wins (argparse keeps the last).
        try:
            given = shlex.split(getattr(args, f"{kind}_args"))
        except ValueError as e:  # an unclosed quote: one line, not shlex's traceback
            raise StartupError(f"--{kind}-args: {e}") from None
        for flag in _WIRED[kind]:
            if any(token == flag or token.startswith(f"{flag}=") for token in given):
                raise StartupError(
                    f"--{kind}-args may not set {flag}: mili serve wires it (the addresses "
                    "the services give each other, the shutdown's wait); use mili serve's "
                    "own flags (mili serve --help)"
                )
        return [*tls.flags.get(kind, []), *given]

    # Decode ports are fixed before anything starts: each prefill instance is told the decode
    # instances it may send KV to (its --decode), and they all load their models at once.
    decode_ports = (
        [int(_port(args.decode_port, i)) for i in range(args.decode_instances)]
        if args.decode_port
        else ports.pick_free_ports(args.host, args.decode_instances)
    )
    decode_addresses = ",".join(format_address(args.host, p) for p in decode_ports)

    return Plan(
        tokenizer=[
            "serve-tokenizer",
            *model,
            *common,
            "--port",
            str(args.tokenizer_port),
            *_metrics(metrics_base, 1),
            *extra("tokenizer"),
        ],
        prefills=[
            [
                "serve-prefill",
                *model,
                *engine,
                *memory(prefill_memory),
                *common,
                "--port",
                _port(args.prefill_port, i),
                *_metrics(metrics_base, 2 + i),
                "--decode",
                decode_addresses,
                *extra("prefill"),
            ]
            for i in range(args.prefill_instances)
        ],
        decodes=[
            [
                "serve-decode",
                *model,
                *engine,
                *memory(decode_memory),
                *common,
                "--port",
                str(decode_ports[i]),
                *_metrics(metrics_base, first_decode + i),
                *extra("decode"),
            ]
            for i in range(args.decode_instances)
        ],
        frontends=[
            [
                "serve-frontend",
                *common,
                "--port",
                str(args.port),
                *_http(frontend_http_port(args)),
                *(["--reuse-port"] if frontends > 1 else []),
                *_metrics(metrics_base, 0 if k == 0 else after_decodes + k - 1),
                *streaming,
                *extra("frontend"),
            ]
            for k in range(frontends)
        ],
        startup_timeout_s=args.startup_timeout,
        drain_timeout_s=args.drain_timeout,
        fail_fast=args.fail_fast,
        health_tls=tls.health,
        frontend_health_tls=None if args.public_tls == "off" else tls.health,
        tls_demo=None if demo is None else demo["client"],
    )


def check_ports(args: argparse.Namespace) -> None:
    """Fixed ports taken by another process fail now, before any model loads (seconds)."""
    fixed = [("--port", args.port)]  # the frontends share it (and --http-port)
    http = frontend_http_port(args)
    if http:
        fixed += [("--http-port", http)]
    fixed += [("--tokenizer-port", args.tokenizer_port)]
    fixed += [
        ("--prefill-port", _offset(args.prefill_port, i)) for i in range(args.prefill_instances)
    ]
    fixed += [("--decode-port", _offset(args.decode_port, i)) for i in range(args.decode_instances)]
    if args.metrics_port:
        num_children = 1 + num_frontends(args) + args.prefill_instances + args.decode_instances
        fixed += [("--metrics-port", args.metrics_port + i) for i in range(num_children)]
    ports.check_distinct(fixed)
    for flag, port in fixed:
        ports.check_free(args.host, port, flag)


def _offset(base: int, i: int) -> int:
    return base + i if base else 0
