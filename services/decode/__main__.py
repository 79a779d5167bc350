"""`mili serve-decode`: the decode service (DecodeService + KvTransferService) as a process.

Owns one model and one KV block pool; admits requests by reserving their blocks, receives each
prompt's KV from a prefill instance, and streams tokens from a continuously batched decode loop.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import logging

from mili import flags
from mili.discovery import ANY, PeerSet
from mili.errors import StartupError
from mili.rpc.server import ServerConfig
from services.decode import config as decode_config

DEFAULT_PORT = 50054
_LOG = logging.getLogger("mili.decode")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model_argument(parser)
    decode_config.add_arguments(parser)
    flags.add_server_arguments(parser, DEFAULT_PORT)
    parser.add_argument(
        "--prefill",
        metavar="TARGET[,TARGET...]",
        action="append",
        default=[],
        help="hosts KV transfers are accepted from: host:port or dns:///NAME:PORT of the "
        "prefill instances (their host is what counts: a caller's port is ephemeral), "
        f"repeatable; '{ANY}' accepts any. Default: any holder of a certificate --tls-ca "
        "signed on an mTLS port, else this machine only",
    )


def run(args: argparse.Namespace) -> int:
    flags.setup_logging(args)
    flags.check_ports(args)  # a taken port fails now, not after loading the model
    model_dir = flags.resolve_model(args)
    try:
        config = decode_config.DecodeConfig.from_args(args, model_dir)
        engine = dataclasses.replace(config.engine, dtype=flags.choose_dtype(args, _LOG))
        config = dataclasses.replace(config, engine=engine)
        server_config = flags.server_config(args)
        kv_senders = _kv_senders(args, server_config)
    except ValueError as e:
        raise StartupError(str(e)) from None
    # Heavy imports (torch, the model) only when actually serving, not for `mili --help`.
    from prometheus_client import CollectorRegistry

    from mili.rpc.server import RpcServer, serve_forever
    from mili.telemetry.metrics import DecodeMetrics
    from mili.telemetry.tracing import start_tracing
    from services.decode.instance import DecodeInstance
    from services.decode.server import add_to_server

    registry = CollectorRegistry()  # this process's metrics, served on --metrics-port
    instance = DecodeInstance.load(config, DecodeMetrics(registry))  # StartupError: what is wrong
    tracing = start_tracing(args, "decode")
    server = RpcServer(
        server_config,
        name="decode",
        interceptors=tracing.server_interceptors(),
        registry=registry,
    )
    add_to_server(server, instance, kv_senders=kv_senders)
    instance.start()  # logs model, device, dtype, KV pool, CUDA graphs and attention backend
    try:
        asyncio.run(serve_forever(server))
    finally:
        instance.stop()  # fails what is left and frees its blocks
        tracing.shutdown()  # last: flushes the spans of the final steps too
    return 0


def _kv_senders(args: argparse.Namespace, server: ServerConfig) -> PeerSet | None:
    """Who may push KV: --prefill's hosts; else, on an mTLS port, whoever completed the
    handshake (a certificate the CA signed); else this machine only (None)."""
    if args.prefill:
        try:
            return PeerSet.parse(args.prefill)
        except ValueError as e:
            raise ValueError(f"--prefill: {e}") from None
    if server.tls is not None and server.tls.require_client_auth:
        return PeerSet((), is_any=True)
    if not ipaddress.ip_address(_host_ip(server.host)).is_loopback:
        _LOG.warning(
            "--host %s without mTLS or --prefill: KV transfers are accepted from this machine "
            "only; name the prefill instances with --prefill, or use --tls-ca",
            server.host,
        )
    return None


def _host_ip(host: str) -> str:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return "127.0.0.1" if host == "localhost" else "0.0.0.0"
    return host


if __name__ == "__main__":
    from mili.cli import main

    raise SystemExit(main(["serve-decode", *__import__("sys").argv[1:]]))
