"""The `mili` command: start services, build the demo model.

Each `serve-*` command lives in its service's `__main__` module, which provides
`add_arguments(parser)` and `run(args) -> int` and keeps heavy imports (torch) inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from mili import __version__
from mili.errors import StartupError

# command -> (module providing add_arguments/run, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve-tokenizer": ("services.tokenizer.__main__", "run the tokenizer service"),
    "serve-prefill": ("services.prefill.__main__", "run a prefill service"),
    "serve-decode": ("services.decode.__main__", "run a decode service"),
    "serve-frontend": ("services.frontend.__main__", "run the frontend (public GenerationService)"),
    "serve": ("mili.serve.launcher", "run tokenizer, prefill, decode and frontend on this machine"),
    "generate": ("mili.client.generate", "generate text through a running frontend"),
    "bench": ("mili.client.bench", "benchmark a running deployment (TTFT, ITL, tokens/s)"),
    "kernels": ("kernels.cli", "build the Mojo attention kernels ahead of first use"),
}


def _demo_model(args: argparse.Namespace) -> int:
    from mili.demo.model import build_demo_model, describe

    directory = Path(args.dir)
    if directory.exists() and not directory.is_dir():
        raise StartupError(f"{directory} exists and is not a directory; choose a new directory")
    if directory.exists() and any(directory.iterdir()):
        raise StartupError(f"{directory} exists and is not empty; choose a new directory")
    try:
        build_demo_model(directory, moe=args.moe)
    except OSError as e:
        raise StartupError(f"cannot write the demo model to {directory}: {e}") from None
    print(describe(directory))
    return 0


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the command named in `argv` has its module imported.

    Importing a service pulls in torch and the service's own code, so `mili --help` or
    `mili serve-tokenizer` never pays for (or breaks on) the other commands.
    """
    parser = argparse.ArgumentParser(
        prog="mili", description="Serve Qwen3 models over gRPC with disaggregated prefill/decode."
    )
    parser.add_argument("--version", action="version", version=f"mili {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo-model", help="write the small random-weight Qwen3 demo checkpoint into DIR"
    )
    demo.add_argument("dir", metavar="DIR")
    demo.add_argument(
        "--moe",
        action="store_true",
        help="a Qwen3-MoE checkpoint instead (8 experts, 2 active; per-expert tensors, sharded)",
    )
    demo.set_defaults(func=_demo_model)

    chosen = next((a for a in (argv or []) if not a.startswith("-")), None)
    subs = {"demo-model": demo}
    for name, (module_name, help_text) in COMMANDS.items():
        # The module docstring is the description, laid out as written (tables, examples).
        sub = commands.add_parser(
            name, help=help_text, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        if name == chosen:
            module = importlib.import_module(module_name)
            sub.description = module.__doc__
            module.add_arguments(sub)
            sub.set_defaults(func=module.run)
        subs[name] = sub
    parser.set_defaults(subparsers=subs)
    return parser


def _parse(argv: list[str]) -> argparse.Namespace:
    """The arguments; an unknown flag of a command is that command's error, with its usage
    (argparse leaves a subcommand's leftovers to the top parser, whose usage says nothing
    of the command's flags: `mili serve-decode --bogus` printed `usage: mili COMMAND ...`)."""
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    subparsers = args.subparsers
    del args.subparsers
    if extra:
        subparsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:
        # The reader of our output is gone (`mili generate "..." | head -c 100`, `mili serve
        # --help | head`): stop without a traceback, as a tool that SIGPIPE ends does. Both
        # streams point at /dev/null from here, so the interpreter's own flush at exit has
        # nothing left to fail on.
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            os.dup2(devnull, stream.fileno())
        return 1


def _run(argv: list[str]) -> int:
    args = _parse(argv)
    try:
        return int(args.func(args))
    except StartupError as e:
        print(f"mili {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
