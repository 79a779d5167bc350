"""`mili serve-frontend`: the public GenerationService, scheduling onto tokenizer, prefill and
decode instances. It holds no model and no KV: only addresses, limits and routing state."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

from mili import flags, ports
from mili.console import to_stdout
from mili.errors import StartupError
from mili.rpc.server_config import ServerConfig

if TYPE_CHECKING:
    from services.frontend.http_api.server import HttpConfig

DEFAULT_PORT = 50051
DEFAULT_TOKENIZER = "127.0.0.1:50052"
DEFAULT_PREFILL = "127.0.0.1:50053"
DEFAULT_DECODE = "127.0.0.1:50054"

# The public port's request limit: the largest valid request plus headroom, not grpc's 64 MiB
# (a 60 MB prompt used to be read, copied and forwarded before the tokenizer refused it, adding
# ~130 MB of RSS each time). The largest valid GenerateRequest/CompleteRequest:
#   text          the tokenizer's --max-input-chars (1,000,000) characters of prompt, or of chat
#                 contents plus reasoning, at up to 4 bytes of UTF-8 each      4,000,000 B
#   chat framing  ~26 B per message (tags, lengths, a role); each message takes >= 5 tokens of
#                 context, so <= 52,429 messages in a 262,144-token window     1,363,154 B
#   (token_ids    <= 262,144 ids of <= 5 B each instead of text: less        1,310,720 B)
#   the rest      request id 256 chars, 16 stop strings of 256 chars, 64 stop ids  ~18 KB
# ~5.4 MB in all; 8 MiB leaves room. Raise it with the tokenizer's --max-input-chars.
MAX_REQUEST_BYTES = 8 * 1024 * 1024
# A fixed 1 MiB receive window: refused 60 MB prompts leave no buffers behind (with grpc's
# bandwidth probe, ten of them still left ~130 MiB), and a valid 4 MB prompt needs only a few
# round trips.
REQUEST_WINDOW_BYTES = 1024 * 1024


PUBLIC_TLS = ("mtls", "tls", "off")


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


def _names(text: str | None) -> tuple[str, ...]:
    """--served-model-name, each name once: an empty one between commas is refused by the
    config."""
    if text is None:
        return ()
    return tuple(dict.fromkeys(name.strip() for name in text.split(",")))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("instances")
    group.add_argument(
        "--tokenizer",
        default=DEFAULT_TOKENIZER,
        metavar="ADDR",
        help="tokenizer service address (default: %(default)s)",
    )
    group.add_argument(
        "--prefill",
        default=DEFAULT_PREFILL,
        metavar="TARGET[,TARGET...]",
        help="prefill instances, comma-separated: host:port, or dns:///NAME:PORT for every "
        "address NAME resolves to (looked up again every --resolve-interval) (default: "
        "%(default)s)",
    )
    group.add_argument(
        "--decode",
        default=DEFAULT_DECODE,
        metavar="TARGET[,TARGET...]",
        help="decode instances, as --prefill (default: %(default)s)",
    )
    group.add_argument(
        "--resolve-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how often dns:/// targets are looked up again: new instances join once their "
        "Info and KV layout check out, vanished ones drain (default: %(default)s)",
    )
    api = parser.add_argument_group("public API")
    api.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME[,NAME...]",
        help="the model names requests may name, comma-separated; the first is the one the "
        "APIs report (default: the tokenizer's, the model directory's name)",
    )
    api.add_argument(
        "--sampling-defaults",
        choices=("model", "none"),
        default="model",
        help="what a request's unset temperature, top_p, top_k, min_p and repetition_penalty "
        "become: model: the checkpoint's generation_config.json values, as vLLM and SGLang "
        "use them (Qwen3's: temperature 0.6, top_p 0.95, top_k 20), SamplingParams' own for "
        "fields it does not set; none: SamplingParams' own (temperature 1, no truncation) "
        "(default: %(default)s)",
    )
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="max_tokens of a request that leaves it unset (default: what the context window "
        "leaves after the prompt, as vLLM's; decode reserves KV for a request's first outputs "
        "and grows it as it runs, preempting the newest request when it runs out)",
    )
    limits.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        metavar="N",
        help="largest max_tokens accepted (default: the model's context window)",
    )
    limits.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=4096,
        help="requests in flight at once, waiting in the admission queue included; more get "
        "RESOURCE_EXHAUSTED (default: %(default)s)",
    )
    limits.add_argument(
        "--max-queued-requests",
        type=int,
        default=2048,  # FrontendConfig says why
        metavar="N",
        help="requests that found every decode instance full wait for room in the admission "
        "queue, by priority then first come first served, until their deadline; past N waiting (or "
        "--max-queued-tokens) a request gets RESOURCE_EXHAUSTED with a retry hint (one that "
        "prefill turned away after decode admitted it goes back in line even past it); 0: "
        "none waits (default: %(default)s)",
    )
    limits.add_argument(
        "--max-queued-tokens",
        type=int,
        default=1 << 22,
        metavar="N",
        help="prompt tokens of the requests waiting in the admission queue, at most (a request "
        "alone in it may pass it, and one that prefill turned away) (default: %(default)s)",
    )
    limits.add_argument(
        "--max-buffered-tokens",
        type=int,
        default=1024,
        metavar="N",
        help="token ids one streamed request holds for a client that reads slower than they "
        "come, sent merged in its next message; past it the request stops pulling until the "
        "client reads (default: %(default)s)",
    )
    limits.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="N",
        help="token ids a streamed request gathers before it sends a message (its first and "
        "last go out at once): N times fewer messages and less CPU per token, for tokens that "
        "wait up to N-1 decode steps (default: %(default)s, every token as it comes)",
    )
    limits.add_argument(
        "--status-history",
        type=int,
        default=1024,
        metavar="N",
        help="ended requests whose status GET /status/{request_id} still reports, the oldest "
        "forgotten first (requests in flight always are; default: %(default)s)",
    )
    routing = parser.add_argument_group("routing")
    routing.add_argument(
        "--poll-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="how often each instance's Info (load, layout) is polled (default: %(default)s)",
    )
    routing.add_argument(
        "--hung-after",
        type=float,
        default=10.0,  # FrontendConfig.hung_after_s says why
        metavar="SECONDS",
        help="an instance that answered no Info poll for SECONDS is hung (stopped, not dead: "
        "its connection stays open): the calls out on it are cut, those without a token yet "
        "start again elsewhere (default: %(default)s)",
    )
    routing.add_argument(
        "--kv-lease-ms",
        type=int,
        default=0,
        help="how long decode holds a reservation waiting for the KV; 0 = decode's default "
        "(default: %(default)s)",
    )
    flags.add_server_arguments(
        parser,
        DEFAULT_PORT,
        max_receive_message_bytes=MAX_REQUEST_BYTES,
        receive_window_bytes=REQUEST_WINDOW_BYTES,
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also serve the HTTP API (OpenAI-compatible /v1/..., /generate, /status, /health) "
        "on --host:PORT, 0 for a free port, with the public port's TLS (default: off)",
    )
    parser.add_argument(
        "--reuse-port",
        action="store_true",
        help="share --port and --http-port with other frontend processes of this user that "
        "set it too (SO_REUSEPORT): the kernel spreads clients' connections over them (`mili "
        "serve --frontends N` sets it)",
    )
    parser.add_argument(
        "--public-tls",
        choices=PUBLIC_TLS,
        default=None,
        help="the public port: mtls (clients need a certificate --tls-ca signed), tls (any "
        "client, the port proves itself with --tls-cert) or off (plaintext, e.g. behind a "
        "TLS-terminating proxy); calls to the other services use the --tls-* flags either way "
        "(default: mtls with --tls-ca and --tls-cert, tls with --tls-cert alone, else off)",
    )


def run(args: argparse.Namespace) -> int:
    flags.setup_logging(args)
    # a taken port fails now, not after start-up work
    flags.check_ports(args, reuse_port=args.reuse_port)
    if args.http_port:
        ports.check_distinct([("--port", args.port), ("--http-port", args.http_port)])
        ports.check_free(args.host, args.http_port, "--http-port", reuse_port=args.reuse_port)
    # Imported here: `mili --help` must not pay for the frontend's imports.
    from mili.rpc.server import RpcServer, serve_forever
    from mili.telemetry.metrics import FrontendMetrics
    from mili.telemetry.tracing import start_tracing
    from services.frontend.backends import Backends
    from services.frontend.config import FrontendConfig
    from services.frontend.generations import Generations
    from services.frontend.http_api.app import make_app
    from services.frontend.http_api.server import HttpServer
    from services.frontend.router import Router
    from services.frontend.server import GenerationServicer, add_to_server
    from services.frontend.validation import Limits

    try:
        config = FrontendConfig(
            tokenizer_address=args.tokenizer,
            prefill_addresses=_addresses(args.prefill),
            decode_addresses=_addresses(args.decode),
            limits=Limits(
                default_max_tokens=args.default_max_tokens,
                max_tokens_limit=args.max_tokens_limit,
            ),
            poll_interval_s=args.poll_interval,
            hung_after_s=args.hung_after,
            resolve_interval_s=args.resolve_interval,
            kv_lease_ms=args.kv_lease_ms,
            max_concurrent_requests=args.max_concurrent_requests,
            max_queued_requests=args.max_queued_requests,
            max_queued_tokens=args.max_queued_tokens,
            max_buffered_tokens=args.max_buffered_tokens,
            stream_interval=args.stream_interval,
            status_history=args.status_history,
            served_model_names=_names(args.served_model_name),
            model_sampling_defaults=args.sampling_defaults == "model",
        )
        tls = flags.client_tls(args)
        server_config = _server_config(args)
        http_config = _http_config(args, server_config)
    except ValueError as e:
        raise StartupError(str(e)) from None
    logging.getLogger("mili.frontend").info(
        "frontend: tokenizer %s, prefill %s, decode %s",
        config.tokenizer_address,
        ", ".join(config.prefill_addresses),
        ", ".join(config.decode_addresses),
    )

    tracing = start_tracing(args, "frontend")

    async def main() -> None:
        server = RpcServer(
            server_config, name="frontend", interceptors=tracing.server_interceptors()
        )
        metrics = FrontendMetrics(server.registry)
        backends = Backends(
            config,
            Router(),  # members come from the targets, fixed or looked up
            interceptors=tracing.client_interceptors(),
            on_health=server.set_serving,  # NOT_SERVING while no usable backends
            tls=tls,
            metrics=metrics,
        )
        router = backends.router
        metrics.watch_instances(lambda: [(m.kind, m.state.value) for m in router.members()])
        generations = Generations(backends, metrics)
        add_to_server(server, GenerationServicer(generations))
        await backends.start()
        http = None
        try:
            if http_config is not None:
                http = HttpServer(make_app(generations, http_config), http_config)
                await http.start()
                server.add_drain_hook(http.drain)
                to_stdout(f"frontend http on {http.url}\n")  # before the port's line
            await serve_forever(server)
        finally:
            if http is not None:
                await http.drain()
            await backends.close()

    try:
        asyncio.run(main())
    finally:
        tracing.shutdown()  # after the drain: flush the last requests' spans
    return 0


def _http_config(args: argparse.Namespace, public: ServerConfig) -> HttpConfig | None:
    """The HTTP port (None: off): the public port's host, TLS, body limit and drain time."""
    from services.frontend.http_api.server import HttpConfig

    if args.http_port is None:
        return None
    tls = public.tls
    return HttpConfig(
        host=args.host,
        port=args.http_port,
        max_body_bytes=args.max_receive_message_bytes,
        drain_timeout_s=args.drain_timeout,
        tls=None if tls is None else flags.tls_files(args),
        require_client_auth=tls is not None and tls.require_client_auth,
        reuse_port=args.reuse_port,
    )


def _server_config(args: argparse.Namespace) -> ServerConfig:
    """The public port: --public-tls decides, the --tls-* files serve it; --reuse-port shares
    it."""
    mode = args.public_tls
    if mode is None:
        mode = "off" if args.tls_cert is None else "mtls" if args.tls_ca is not None else "tls"
    if mode == "off":
        public = argparse.Namespace(**{**vars(args), "tls_cert": None, "tls_key": None})
        config = flags.server_config(public, require_client_auth=False)
    elif args.tls_cert is None:
        raise ValueError(f"--public-tls {mode} needs --tls-cert and --tls-key")
    else:
        config = flags.server_config(args, require_client_auth=mode == "mtls")
    return dataclasses.replace(config, reuse_port=args.reuse_port)


if __name__ == "__main__":
    from mili.cli import main

    raise SystemExit(main(["serve-frontend", *__import__("sys").argv[1:]]))
