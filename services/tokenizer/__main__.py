"""`mili serve-tokenizer`: the tokenizer service as a process."""

from __future__ import annotations

import argparse
import asyncio
import logging

from mili import flags
from mili.errors import StartupError
from mili.rpc.policy import SMALL_REQUESTS_WINDOW_BYTES
from mili.rpc.server import RpcServer, serve_forever
from services.tokenizer.server import TokenizerLimits, TokenizerServicer, add_to_server
from services.tokenizer.tokenizer import ModelTokenizer

DEFAULT_PORT = 50052


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model_argument(parser)
    flags.add_server_arguments(
        parser, DEFAULT_PORT, receive_window_bytes=SMALL_REQUESTS_WINDOW_BYTES
    )
    limits = TokenizerLimits()
    parser.add_argument(
        "--max-input-chars",
        type=int,
        default=limits.max_input_chars,
        help="longest text or conversation accepted, in characters (default: %(default)s)",
    )
    parser.add_argument(
        "--max-token-ids",
        type=int,
        default=limits.max_token_ids,
        help="most token ids per detokenize message (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    flags.setup_logging(args)
    flags.check_ports(args)  # a taken port fails now, not after start-up work
    model_dir = flags.resolve_model(args)
    try:
        limits = TokenizerLimits(args.max_input_chars, args.max_token_ids)
        server_config = flags.server_config(args)
    except ValueError as e:  # as every service: the flag's one line, no traceback
        raise StartupError(str(e)) from None
    tokenizer = ModelTokenizer(model_dir)  # raises StartupError naming what is missing
    logging.getLogger("mili.tokenizer").info(
        "tokenizer for %s: vocab %d, eos %s, chat template %s",
        model_dir,
        tokenizer.vocab_size,
        tokenizer.eos_token_ids,
        tokenizer.chat_template.source,
    )
    from mili.telemetry.tracing import start_tracing

    tracing = start_tracing(args, "tokenizer")
    server = RpcServer(server_config, name="tokenizer", interceptors=tracing.server_interceptors())
    add_to_server(server, TokenizerServicer(tokenizer, limits))
    try:
        asyncio.run(serve_forever(server))
    finally:
        tracing.shutdown()  # after the drain: flush the last calls' spans
    return 0


if __name__ == "__main__":
    from mili.cli import main

    raise SystemExit(main(["serve-tokenizer", *__import__("sys").argv[1:]]))
