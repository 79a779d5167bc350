"""`mili COMMAND --help` lists every setting with its default, as README.md says it does."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from mili.cli import COMMANDS, build_parser, main


def _command_parser(name: str) -> argparse.ArgumentParser:
    parser = build_parser([name])
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def _says_nothing(default: object) -> bool:
    # By identity and type: 0 == False, and a default of 0 is worth saying.
    return default is None or isinstance(default, bool) or default in ("", [], argparse.SUPPRESS)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_option_with_a_default_says_it(name: str) -> None:
    """An option left out takes its default; a user reading --help should learn which. Flags
    (store_true/false) and empty defaults (repeatable or pass-through options) say nothing."""
    silent = [
        action.option_strings[0]
        for action in _command_parser(name)._actions
        if action.option_strings
        and not _says_nothing(action.default)
        and "default" not in (action.help or "")
    ]
    assert silent == [], f"mili {name} --help gives no default for {silent}"


def test_a_commands_description_keeps_its_layout() -> None:
    """The module docstring is the description: its table of metrics stays a table."""
    result = subprocess.run(
        [sys.executable, "-m", "mili", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert (
        "\n    TTFT           send (open loop: arrival) -> first message carrying token ids\n"
        in result.stdout
    )


def test_demo_model_refuses_a_directory_it_cannot_use_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file, a non-empty directory or a place it cannot create: `mili demo-model: error:`
    and exit 2 (a file or a path under a file was a traceback)."""
    (tmp_path / "file").write_text("hi")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    for target, words in (
        (tmp_path / "file", f"{tmp_path / 'file'} exists and is not a directory"),
        (tmp_path / "full", f"{tmp_path / 'full'} exists and is not empty"),
        (tmp_path / "file" / "under", "cannot write the demo model to"),
    ):
        assert main(["demo-model", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"mili demo-model: error: {words}") and err.count("\n") == 1, err


@pytest.mark.parametrize("name", ["serve-decode", "serve", "bench"])
def test_an_unknown_flag_is_its_commands_error_with_its_usage(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`mili serve --decode-args "--bogus 1"` started decode, which printed `mili`'s own usage
    (`mili COMMAND ...`), which says nothing of the flags decode takes."""
    with pytest.raises(SystemExit) as exited:
        main([name, "--bogus", "1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: mili {name} " in err
    assert f"mili {name}: error: unrecognized arguments: --bogus 1" in err
