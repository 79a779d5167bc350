"""`mili serve-prefill`: the prefill service as a process (owns a model and a KV block pool)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging

from kernels import ATTENTION_CHOICES, DEFAULT_ATTENTION
from mili import flags
from mili.engine.kv_layout import DEFAULT_BLOCK_SIZE, DTYPES
from mili.errors import StartupError
from services.prefill.config import (
    ANY_DECODE,
    DEFAULT_MAX_BATCH_TOKENS,
    parse_allowed_decodes,
)

DEFAULT_PORT = 50053
_LOG = logging.getLogger("mili.prefill")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model_argument(parser)
    parser.add_argument(
        "--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="weights' and KV cache's element type (default: the fastest on the device: "
        "float32 on CPU, bfloat16 on CUDA)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="tokens per KV block; must equal the decode instances' (default: %(default)s)",
    )
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument(
        "--kv-cache-bytes", type=int, default=None, help="memory for this instance's KV blocks"
    )
    pool.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks in this instance's pool (default: enough for --max-queued-tokens)",
    )
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
        metavar="ADDR[,ADDR...]",
        action="append",
        default=[],
        help="decode instances this prefill may send KV to, host:port as the frontend names "
        "them (repeatable); a request naming any other destination is refused with "
        f"PERMISSION_DENIED before any connection is made. '{ANY_DECODE}' allows any (only "
        "where every peer is trusted). Required",
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,
        default=DEFAULT_ATTENTION,
        help="attention backend: mojo kernels, the torch reference, or auto = mojo where the "
        "kernels build for the device, else torch (default: %(default)s)",
    )
    flags.add_server_arguments(parser, DEFAULT_PORT)


def run(args: argparse.Namespace) -> int:
    flags.setup_logging(args)
    flags.check_ports(args)  # a taken port fails now, not after loading the model
    from mili.engine.config import ConfigError, Qwen3Config
    from services.prefill.config import PrefillConfig

    model_dir = flags.resolve_model(args)
    if not (model_dir / "config.json").is_file():
        raise StartupError(f"model directory {model_dir} does not exist or has no config.json")
    try:
        model_config = Qwen3Config.from_file(model_dir / "config.json")
    except ConfigError as e:
        raise StartupError(f"{model_dir}: {e}") from None
    try:
        # Flags first, without torch (seconds to import): a typo fails at once.
        config = PrefillConfig(
            num_blocks=1 if args.num_blocks is None else args.num_blocks,
            block_size=args.block_size,
            max_batch_tokens=args.max_batch_tokens,
            max_queued_tokens=(
                4 * args.max_batch_tokens
                if args.max_queued_tokens is None
                else args.max_queued_tokens
            ),
            transfer_timeout_s=args.transfer_timeout,
            allowed_decodes=parse_allowed_decodes(args.decode),
        )
    except ValueError as e:
        raise StartupError(f"--decode: {e}" if "allowed decode" in str(e) else str(e)) from None

    import torch  # heavy imports only once the flags are known to be good
    from prometheus_client import CollectorRegistry

    from kernels.backend import select_attention
    from kernels.build import KernelBuildError
    from mili.engine.block_pool import blocks_needed
    from mili.engine.fingerprint import model_fingerprint
    from mili.engine.kv_cache import bytes_per_block
    from mili.engine.loader import CheckpointError, load_model, resolve_dtype
    from mili.rpc.server import RpcServer, serve_forever
    from mili.telemetry.metrics import PrefillMetrics
    from mili.telemetry.tracing import start_tracing
    from services.prefill.server import PrefillServicer, add_to_server

    try:
        device = torch.device(args.device)
        dtype = resolve_dtype(flags.choose_dtype(args, _LOG))
    except (RuntimeError, ConfigError) as e:
        raise StartupError(f"--device/--dtype: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise StartupError(f"--device {args.device}: no CUDA device is available")
    if args.num_blocks is None:
        if args.kv_cache_bytes is not None:
            num_blocks = args.kv_cache_bytes // bytes_per_block(
                model_config, config.block_size, dtype
            )
        else:  # enough for every token the queue bound admits
            num_blocks = blocks_needed(config.max_queued_tokens, config.block_size)
        try:
            config = dataclasses.replace(config, num_blocks=num_blocks)
        except ValueError as e:
            raise StartupError(f"--kv-cache-bytes: {e}") from None
    if not config.allowed_decodes:
        raise StartupError(
            "--decode is required: the decode instances this prefill may send KV to "
            f"(host:port, as the frontend names them), or '{ANY_DECODE}' for any"
        )
    if ANY_DECODE in config.allowed_decodes:
        _LOG.warning("--decode '%s': KV goes to any destination a caller names", ANY_DECODE)
    try:
        attention = select_attention(args.attention, device, head_dim=model_config.head_dim)
    except KernelBuildError as e:
        raise StartupError(f"--attention {args.attention}: {e}") from None
    try:
        model = load_model(model_dir, device=device, dtype=dtype, attention=attention)
    except (CheckpointError, ConfigError, RuntimeError) as e:
        raise StartupError(f"cannot load {model_dir}: {e}") from None
    tracing = start_tracing(args, "prefill")
    registry = CollectorRegistry()  # this process's metrics, served on --metrics-port
    try:
        server_config = flags.server_config(args)
        servicer = PrefillServicer(
            model,
            config,
            model_name=model_dir.name,
            fingerprint=model_fingerprint(model_dir),
            max_message_bytes=server_config.max_message_bytes,
            client_interceptors=tracing.client_interceptors(),
            metrics=PrefillMetrics(registry),
        )
    except ValueError as e:
        raise StartupError(str(e)) from None
    _LOG.info(
        "prefill for %s on %s: dtype %s, %d KV blocks of %d tokens, attention %s, "
        "max_batch_tokens %d, max_queued_tokens %d, KV to %s",
        model_dir,
        device,
        str(dtype).removeprefix("torch."),
        config.num_blocks,
        config.block_size,
        model.attention.name,
        config.max_batch_tokens,
        config.max_queued_tokens,
        ", ".join(config.allowed_decodes),
    )
    server = RpcServer(
        server_config,
        name="prefill",
        interceptors=tracing.server_interceptors(),
        registry=registry,
    )
    add_to_server(server, servicer)

    async def serve() -> None:
        try:
            await serve_forever(server)
        finally:
            await servicer.close()

    try:
        asyncio.run(serve())
    finally:
        tracing.shutdown()  # after the drain: flush the last prompts' spans
    return 0


if __name__ == "__main__":
    from mili.cli import main

    raise SystemExit(main(["serve-prefill", *__import__("sys").argv[1:]]))
