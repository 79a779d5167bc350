"""`mili serve-prefill`: the prefill service as a process (owns a model and a KV block pool)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging

from mili import flags
from mili.discovery import ANY, PeerSet
from mili.engine.engine_config import EngineConfig, add_engine_arguments
from mili.errors import StartupError
from mili.rpc.policy import SMALL_REQUESTS_WINDOW_BYTES
from services.prefill.config import DEFAULT_MAX_BATCH_TOKENS, PrefillConfig

DEFAULT_PORT = 50053
_LOG = logging.getLogger("mili.prefill")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model_argument(parser)
    add_engine_arguments(parser, default_pool="enough blocks for --max-queued-tokens")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=DEFAULT_MAX_BATCH_TOKENS,
        help="most prompt tokens in one forward; longer prompts are chunked (default: %(default)s)",
    )
    parser.add_argument(
        "--max-queued-tokens",
        type=int,
        default=None,
        help="most prompt tokens queued, computing or transferring; more is RESOURCE_EXHAUSTED "
        "(default: 4 x --max-batch-tokens)",
    )
    parser.add_argument(
        "--transfer-timeout",
        type=float,
        default=60.0,
        help="seconds from accepting a prompt to decode's acknowledgement of its KV, when the "
        "caller's deadline is later or unset (default: %(default)s)",
    )
    parser.add_argument(
        "--decode",
        metavar="TARGET[,TARGET...]",
        action="append",
        default=[],
        help="decode instances this prefill may send KV to, host:port as the frontend names "
        "them, or dns:///NAME:PORT for every address NAME resolves to (repeatable); a "
        "request naming any other destination is refused with "
        f"PERMISSION_DENIED before any connection is made. '{ANY}' alone allows any (only "
        "where every peer is trusted). Required",
    )
    flags.add_callers_argument(
        parser, "--frontend", "the frontends, the callers that send prompts (Prefill)"
    )
    flags.add_transport_arguments(parser)
    flags.add_server_arguments(
        parser, DEFAULT_PORT, receive_window_bytes=SMALL_REQUESTS_WINDOW_BYTES
    )


def run(args: argparse.Namespace) -> int:
    flags.setup_logging(args)
    flags.check_ports(args)  # a taken port fails now, not after loading the model
    model_dir = flags.resolve_model(args)
    if not (model_dir / "config.json").is_file():
        raise StartupError(f"model directory {model_dir} does not exist or has no config.json")
    try:
        # Flags first, without torch (seconds to import): a typo fails at once.
        config = PrefillConfig(
            engine=EngineConfig.from_args(args),
            max_batch_tokens=args.max_batch_tokens,
            max_queued_tokens=(
                4 * args.max_batch_tokens
                if args.max_queued_tokens is None
                else args.max_queued_tokens
            ),
            transfer_timeout_s=args.transfer_timeout,
            allowed_decodes=tuple(args.decode),
            prefix_caching=args.prefix_caching,
            kv_transport=args.kv_transport,
            host_id=args.host_id,
        )
        server_config = flags.server_config(args)
        frontends = flags.callers(args, "--frontend", server_config, _LOG)
    except ValueError as e:
        message = str(e)
        raise StartupError(message.replace("allowed decodes:", "--decode:", 1)) from None
    if not config.allowed_decodes:
        raise StartupError(
            "--decode is required: the decode instances this prefill may send KV to "
            f"(host:port, as the frontend names them), or '{ANY}' for any"
        )
    if PeerSet.parse(config.allowed_decodes).is_any:
        _LOG.warning("--decode '%s': KV goes to any destination a caller names", ANY)
    engine = dataclasses.replace(config.engine, dtype=flags.choose_dtype(args, _LOG))
    config = dataclasses.replace(config, engine=engine)

    # Heavy imports (torch, the model) only once the flags are known to be good.
    from prometheus_client import CollectorRegistry

    from mili.rpc.server import RpcServer, drain_on_death, serve_forever
    from mili.telemetry.metrics import PrefillMetrics
    from mili.telemetry.tracing import start_tracing
    from mili.watchdog import watch
    from services.prefill.instance import PrefillInstance
    from services.prefill.server import PrefillServicer, add_to_server

    registry = CollectorRegistry()  # this process's metrics, served on --metrics-port
    instance = PrefillInstance.load(config, model_dir, PrefillMetrics(registry))
    tracing = start_tracing(args, "prefill")
    try:
        servicer = PrefillServicer(
            instance,
            max_message_bytes=server_config.max_message_bytes,
            client_interceptors=tracing.client_interceptors(),
            tls=flags.client_tls(args),
            on_death=drain_on_death("prefill"),
        )
    except ValueError as e:
        raise StartupError(str(e)) from None
    _LOG.info("prefill for %s %s", model_dir, instance.describe())
    watchdog = watch(instance.worker.progress, config.engine.watchdog_timeout_s, "prefill")
    server = RpcServer(
        server_config,
        name="prefill",
        interceptors=tracing.server_interceptors(),
        registry=registry,
    )
    add_to_server(server, servicer, frontends=frontends)

    async def serve() -> None:
        try:
            await serve_forever(server)
        finally:
            if watchdog is not None:
                watchdog.stop()  # the worker's last step may take its time now
            await servicer.close()

    try:
        asyncio.run(serve())
    finally:
        tracing.shutdown()  # after the drain: flush the last prompts' spans
    if instance.worker.death is not None:
        return 1  # a supervisor (mili serve, Kubernetes) starts a fresh one
    return 0


if __name__ == "__main__":
    from mili.cli import main

    raise SystemExit(main(["serve-prefill", *__import__("sys").argv[1:]]))
