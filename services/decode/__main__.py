"""`mili serve-decode`: the decode service (DecodeService + KvTransferService) as a process.

Owns one model and one KV block pool; admits requests by reserving their blocks, receives each
prompt's KV from a prefill instance, and streams tokens from a continuously batched decode loop.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging

from mili import flags
from mili.errors import StartupError
from services.decode import config as decode_config

DEFAULT_PORT = 50054
_LOG = logging.getLogger("mili.decode")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model_argument(parser)
    decode_config.add_arguments(parser)
    flags.add_server_arguments(parser, DEFAULT_PORT)
    flags.add_callers_argument(
        parser,
        "--frontend",
        "the frontends, the callers that admit requests (Generate, GenerateStream)",
    )
    flags.add_callers_argument(
        parser, "--prefill", "the prefill instances, the callers that push KV (Pair, TransferKv)"
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
        frontends = flags.callers(args, "--frontend", server_config, _LOG)
        prefills = flags.callers(args, "--prefill", server_config, _LOG)
    except ValueError as e:
        raise StartupError(str(e)) from None
    # Heavy imports (torch, the model) only when actually serving, not for `mili --help`.
    from prometheus_client import CollectorRegistry

    from mili.rpc.server import RpcServer, drain_on_death, serve_forever
    from mili.telemetry.metrics import DecodeMetrics
    from mili.telemetry.tracing import start_tracing
    from mili.watchdog import watch
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
    add_to_server(server, instance, frontends=frontends, prefills=prefills)
    # logs model, device, dtype, KV pool, CUDA graphs and attention backend
    instance.start(on_death=drain_on_death("decode"))
    watchdog = watch(instance.batcher.progress, config.engine.watchdog_timeout_s, "decode")
    try:
        asyncio.run(serve_forever(server))
    finally:
        if watchdog is not None:
            watchdog.stop()  # the batch thread's last step may take its time now
        instance.stop()  # fails what is left and frees its blocks
        tracing.shutdown()  # last: flushes the spans of the final steps too
    if instance.batcher.death is not None:
        return 1  # a supervisor (mili serve, Kubernetes) starts a fresh one
    return 0


if __name__ == "__main__":
    from mili.cli import main

    raise SystemExit(main(["serve-decode", *__import__("sys").argv[1:]]))
