"""`mili serve` borrows its children's flags (mili/serve/forwarded_flags.py): what it hands on
is what the child's own parser reads back, value for value."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mili.cli import build_parser
from mili.errors import StartupError
from mili.serve.forwarded_flags import Borrowed
from mili.serve.launcher import add_arguments
from mili.serve.plan import ENGINE, EVERY_CHILD, FRONTEND, make_plan

GIVEN = [
    "--device", "cuda:1", "--dtype", "bfloat16", "--attention", "torch", "--no-prefix-cache",
    "--log-level", "DEBUG", "--drain-timeout", "2.5", "--otlp-endpoint", "http://127.0.0.1:4317",
    "--trace-console", "--stream-interval", "4", "--max-buffered-tokens", "16",
    "--max-queued-requests", "64", "--max-queued-tokens", "4096", "--host", "127.0.0.2",
    "--served-model-name", "qwen3,Qwen/Qwen3-0.6B", "--default-max-tokens", "4096",
    "--max-concurrent-requests", "100", "--sampling-defaults", "none", "--watchdog-timeout", "60",
    "--hung-after", "20",
]  # fmt: skip


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--decode-port", "1", *argv])  # a fixed port: no port probing


def _child_reads(command: str, argv: list[str]) -> argparse.Namespace:
    # Exactly what the child process parses: `mili <command> <argv>`.
    return build_parser([command]).parse_args([command, *argv])


@pytest.mark.parametrize(
    ("borrowed", "commands"),
    [
        (EVERY_CHILD, ["serve-tokenizer", "serve-prefill", "serve-decode", "serve-frontend"]),
        (ENGINE, ["serve-prefill", "serve-decode"]),
        (FRONTEND, ["serve-frontend"]),
    ],
)
def test_each_child_reads_back_what_serve_was_given(
    borrowed: Borrowed, commands: list[str]
) -> None:
    args = _serve_args(*GIVEN)
    handed_on = borrowed.argv(args)
    assert handed_on, "nothing handed on"
    for command in commands:
        child = _child_reads(command, handed_on)
        for name in borrowed.names:
            dest = name.removeprefix("--no-").removeprefix("--").replace("-", "_")
            dest = {"prefix_cache": "prefix_caching"}.get(dest, dest)
            assert getattr(child, dest) == getattr(args, dest), (command, name)


def test_flags_not_given_are_left_to_the_child(tmp_path: Path) -> None:
    args = _serve_args()
    assert ENGINE.argv(args) == [] and FRONTEND.argv(args) == []
    # The server flags serve uses itself keep the child's defaults and always go on.
    assert EVERY_CHILD.argv(args) == [
        "--host", "127.0.0.1", "--log-level", "INFO", "--drain-timeout", "30.0",
    ]  # fmt: skip
    plan = make_plan(_serve_args("--device", "cpu", "--no-prefix-cache"), tmp_path)
    for argv in (*plan.prefills, *plan.decodes):
        assert argv[argv.index("--device") + 1] == "cpu" and "--no-prefix-cache" in argv
    assert "--device" not in plan.tokenizer and "--no-prefix-cache" not in plan.frontend


def test_a_flag_the_child_does_not_declare_is_an_error() -> None:
    with pytest.raises(ValueError, match="declares no --no-such-flag"):
        Borrowed(add_arguments, ("--no-such-flag",)).declare(argparse.ArgumentParser(), "x")


@pytest.mark.parametrize(
    ("kind", "given"),
    [
        ("decode", "--port 55415"),  # prefill would be told another decode address
        ("prefill", "--decode=127.0.0.1:9"),
        ("frontend", "--drain-timeout 120"),  # mili serve would kill it mid-drain
        ("tokenizer", "--host ::1"),
    ],
)
def test_kind_args_may_not_set_what_serve_wires(tmp_path: Path, kind: str, given: str) -> None:
    """Such a flag once gave a deployment that looked healthy and failed every request (a
    decode on a port prefill's --decode did not name)."""
    flag = given.split()[0].split("=")[0]
    with pytest.raises(StartupError, match=f"--{kind}-args may not set {flag}"):
        make_plan(_serve_args(f"--{kind}-args={given}"), tmp_path)
    assert make_plan(_serve_args(f"--{kind}-args=--log-level DEBUG"), tmp_path)
