"""Command-line flags every service shares, and the configs built from them."""

from __future__ import annotations

import argparse
import ipaddress
import logging
from pathlib import Path
from typing import Any

from mili import ports
from mili.discovery import ANY, Callers
from mili.kv_handoff import kv_transport
from mili.rpc.server_config import ServerConfig, ServerTls
from mili.rpc.tls import Tls, TlsFiles

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# C0 controls, DEL, C1 controls and the Unicode line/paragraph separators: whatever a terminal or
# a log viewer may take as a line break, a carriage return or an escape sequence. Each becomes
# its Python escape (\n, \r, \x1b, \u2028), so it stays visible and inert.
_CONTROLS = [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029]
_ESCAPES = {code: repr(chr(code))[1:-1] for code in _CONTROLS}
_ESCAPES_BUT_NEWLINE = {code: escape for code, escape in _ESCAPES.items() if code != ord("\n")}


class OneLineFormatter(logging.Formatter):
    """One log record, one line: control characters in the record's line (its message with the
    args merged in, e.g. a client's request id) are escaped, so no client string can forge a
    log line or send the terminal an escape sequence.

    A traceback (exc_info, stack_info), which `format` appends after the record's line, keeps
    its lines; only its other control characters are escaped. Its exception message can still
    hold a newline: tracebacks are for our bugs, logged at ERROR.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(record).translate(_ESCAPES)

    def formatException(self, ei: Any) -> str:
        return super().formatException(ei).translate(_ESCAPES_BUT_NEWLINE)

    def formatStack(self, stack_info: str) -> str:
        return super().formatStack(stack_info).translate(_ESCAPES_BUT_NEWLINE)


_PROBED = "none: grown by grpc's bandwidth probe"


def add_server_arguments(
    parser: argparse.ArgumentParser,
    default_port: int,
    *,
    max_receive_message_bytes: int | None = None,
    receive_window_bytes: int | None = None,
) -> None:
    """The flags of `server_config`. A service whose requests are small (the public frontend)
    passes its own defaults for the last two; None keeps grpc's behaviour (requests up to
    --max-message-bytes, a receive window grown by grpc's bandwidth probe)."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    group.add_argument(
        "--port",
        type=int,
        default=default_port,
        help="port to bind; 0 picks a free one (default: %(default)s)",
    )
    group.add_argument(
        "--max-message-bytes",
        type=int,
        default=64 * 1024 * 1024,
        help="largest gRPC message sent, and received unless --max-receive-message-bytes is "
        "set (default: %(default)s)",
    )
    group.add_argument(
        "--max-receive-message-bytes",
        type=int,
        default=max_receive_message_bytes,
        metavar="BYTES",
        help="largest request message accepted; a larger one is RESOURCE_EXHAUSTED before it "
        f"is read (default: {max_receive_message_bytes or '--max-message-bytes'})",
    )
    group.add_argument(
        "--receive-window-bytes",
        type=int,
        default=receive_window_bytes,
        metavar="BYTES",
        help="fixed per-call HTTP/2 receive window, which bounds what a refused oversized "
        f"request makes the server buffer (default: {receive_window_bytes or _PROBED})",
    )
    group.add_argument(
        "--health-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also serve grpc.health.v1 alone, in plaintext, on this port, for probes that "
        "cannot speak TLS (Kubernetes' grpc probes); service '' and each service name follow "
        "the main port's health, 'liveness' stays SERVING while the process runs, drains "
        "included (default: off)",
    )
    group.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight calls get to finish after SIGTERM (default: %(default)s)",
    )
    group.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level (default: %(default)s)",
    )
    add_tls_arguments(parser)
    telemetry = parser.add_argument_group("telemetry")
    telemetry.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="export traces over OTLP/gRPC to URL, e.g. http://127.0.0.1:4317 (default: "
        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT if set, else off)",
    )
    telemetry.add_argument(
        "--trace-console",
        action="store_true",
        help="also print every finished span to stderr (debugging)",
    )
    telemetry.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics; 0 picks a free port "
        "(default: off)",
    )


def add_tls_arguments(parser: argparse.ArgumentParser, *, is_server: bool = True) -> None:
    """--tls-cert, --tls-key, --tls-ca (mili.rpc.tls)."""
    group = parser.add_argument_group("TLS")
    own = "the port serves TLS and " if is_server else ""
    group.add_argument(
        "--tls-cert",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"this process's certificate chain (PEM): {own}calls to other services present "
        "it (default: plaintext)",
    )
    group.add_argument(
        "--tls-key", type=Path, default=None, metavar="FILE", help="its private key (PEM)"
    )
    ca_server = (
        "the port then requires client certificates it signed (mTLS), and " if is_server else ""
    )
    group.add_argument(
        "--tls-ca",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"the CA certificate (PEM) of the deployment: {ca_server}servers are verified "
        "against it (default: the system's roots)",
    )


def tls_files(args: argparse.Namespace) -> TlsFiles:
    return TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)


def client_tls(args: argparse.Namespace) -> Tls | None:
    """What this process dials other services with: None = plaintext. ValueError when a file
    is missing or the flags do not fit together."""
    files = tls_files(args)
    return files.load() if files.is_enabled else None


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="DIR",
        help="HF checkpoint directory (default: the embedded demo model, built once into the "
        "cache: $MILI_CACHE_DIR, else ~/.cache/mili)",
    )


def server_config(
    args: argparse.Namespace, *, require_client_auth: bool | None = None
) -> ServerConfig:
    """The server's config from the shared flags. TLS when --tls-cert is given, requiring
    client certificates when --tls-ca is (unless `require_client_auth` says otherwise: the
    frontend's public port). ValueError when TLS files are missing or do not fit together."""
    tls = client_tls(args)
    server_tls = None
    if tls is not None and tls.cert is not None:
        require = tls.ca is not None if require_client_auth is None else require_client_auth
        server_tls = ServerTls(tls, require_client_auth=require)
    elif require_client_auth:
        raise ValueError("client certificates are verified only on a TLS port: add --tls-cert")
    return ServerConfig(
        host=args.host,
        port=args.port,
        max_message_bytes=args.max_message_bytes,
        max_receive_message_bytes=args.max_receive_message_bytes,
        receive_window_bytes=args.receive_window_bytes,
        drain_timeout_s=args.drain_timeout,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        tls=server_tls,
    )


def add_callers_argument(parser: argparse.ArgumentParser, flag: str, who: str) -> None:
    """A flag naming the hosts `who` may call from (mili.discovery.Callers), e.g. `--frontend`
    for "the frontends (Generate, GenerateStream)"."""
    parser.add_argument(
        flag,
        metavar="TARGET[,TARGET...]",
        action="append",
        default=[],
        help=f"hosts of {who}: host:port or dns:///NAME:PORT (the host is what counts: a "
        f"caller's port is ephemeral), repeatable; '{ANY}' accepts any. Default: any holder of "
        "a certificate --tls-ca signed on an mTLS port, else this machine only",
    )


def callers(
    args: argparse.Namespace, flag: str, server: ServerConfig, log: logging.Logger
) -> Callers:
    """The Callers of `flag` (added by add_callers_argument); ValueError naming the flag when
    a value is not a target. Warns when a port open to other hosts takes these calls only from
    this machine."""
    values = getattr(args, flag.lstrip("-").replace("-", "_"))
    is_mtls = server.tls is not None and server.tls.require_client_auth
    found = Callers.from_flag(flag, values, host=server.host, is_mtls=is_mtls)
    if found.is_this_machine and not _is_loopback(server.host):
        log.warning(
            "--host %s without mTLS or %s: the calls it names are accepted from this machine "
            "only; name the callers' hosts with %s, or use --tls-ca",
            server.host,
            flag,
            flag,
        )
    return found


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_ports(args: argparse.Namespace, *, reuse_port: bool = False) -> None:
    """--port and --metrics-port: StartupError now if another process holds one, before the
    service spends seconds loading a model only to fail binding it. `reuse_port`: --port is
    shared (SO_REUSEPORT), so siblings holding it pass."""
    ports.check_free(args.host, args.port, "--port", reuse_port=reuse_port)
    if args.metrics_port is not None:
        ports.check_free(args.host, args.metrics_port, "--metrics-port")
    if args.health_port is not None:
        ports.check_free(args.host, args.health_port, "--health-port")


def default_dtype(device: str) -> tuple[str, str]:
    """The element type prefill and decode run in on `device` without --dtype, and why."""
    if device.startswith("cuda"):
        return "bfloat16", "GPUs run bfloat16 at full tensor-core rate, on half the bytes"
    # CPUs without bfloat16 matrix units convert in every matmul; the measurement is in
    # docs/benchmarks.md ("Measurements behind choices in the code").
    return "float32", "CPU matmuls run faster in float32 than in bfloat16"


def choose_dtype(args: argparse.Namespace, log: logging.Logger) -> str:
    """--dtype, or the device's default; logs which and why in one line."""
    if args.dtype is not None:
        log.info("dtype %s on %s: as --dtype asks", args.dtype, args.device)
        return str(args.dtype)
    dtype, why = default_dtype(args.device)
    log.info("dtype %s on %s: the device's default (no --dtype): %s", dtype, args.device, why)
    return dtype


def setup_logging(args: argparse.Namespace) -> None:
    """Every record of the process (ours, grpc's, any library's) through one stderr handler
    with the OneLineFormatter. Each service's (and `mili serve`'s) `run` calls this first."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(LOG_FORMAT))
    logging.basicConfig(level=args.log_level, handlers=[handler], force=True)


def resolve_model(args: argparse.Namespace) -> Path:
    """--model, or the demo model (built on first use)."""
    if args.model is not None:
        return Path(args.model)
    from mili.demo.model import default_model_dir  # imports torch: only when needed

    return default_model_dir()


def add_transport_arguments(parser: argparse.ArgumentParser) -> None:
    """--kv-transport and --host-id (prefill has the same two)."""
    parser.add_argument(
        "--kv-transport",
        default="auto",
        choices=kv_transport.CHOICES,
        help="how KV bytes move between prefill and decode: auto = the fastest both can use "
        "(cuda-ipc or shm on one host, else grpc), or force one: a pair that cannot use it "
        "warns and takes grpc (default: %(default)s)",
    )
    parser.add_argument(
        "--host-id",
        default=None,
        help="identity of this host for KV transports (default: boot id and namespaces; only "
        "equal ids share memory)",
    )
