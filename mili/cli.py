"""The `mili` command: start services, build the demo model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mili.errors import StartupError


def _demo_model(args: argparse.Namespace) -> int:
    from mili.demo.model import build_demo_model, describe

    directory = Path(args.dir)
    if directory.exists() and any(directory.iterdir()):
        raise StartupError(f"{directory} exists and is not empty; choose a new directory")
    build_demo_model(directory)
    print(describe(directory))
    return 0


def _serve_tokenizer(args: argparse.Namespace) -> int:
    from services.tokenizer.__main__ import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from services.tokenizer.__main__ import add_arguments as tokenizer_arguments

    parser = argparse.ArgumentParser(
        prog="mili", description="Serve Qwen3 models over gRPC with disaggregated prefill/decode."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo-model", help="write the small random-weight Qwen3 demo checkpoint into DIR"
    )
    demo.add_argument("dir", metavar="DIR")
    demo.set_defaults(func=_demo_model)

    tokenizer = commands.add_parser("serve-tokenizer", help="run the tokenizer service")
    tokenizer_arguments(tokenizer)
    tokenizer.set_defaults(func=_serve_tokenizer)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except StartupError as e:
        print(f"mili {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
