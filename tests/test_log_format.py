"""The log format every service installs (mili.flags.setup_logging): one record, one line, with
control characters from client strings escaped; tracebacks keep their lines."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

from mili.flags import LOG_FORMAT, OneLineFormatter
from tests.service_process import ROOT

CONTROLS = "a\nb\rc\x1b[31md\x00e\x7ff\x85g\u2028h\u2029i\tj"
ESCAPED = "a\\nb\\rc\\x1b[31md\\x00e\\x7ff\\x85g\\u2028h\\u2029i\\tj"


def _format(msg: str, *args: object, exc_info: object = None) -> str:
    record = logging.LogRecord("mili.test", logging.INFO, __file__, 1, msg, args, exc_info)
    return OneLineFormatter(LOG_FORMAT).format(record)


def test_control_characters_in_args_and_message_are_escaped() -> None:
    line = _format("%s done, prompt %r", CONTROLS, "x\ny")
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert line.endswith(f"INFO mili.test: {ESCAPED} done, prompt 'x\\ny'")
    assert _format(CONTROLS).endswith(f": {ESCAPED}")
    assert _format("plain ascii and ünïcödé").endswith(": plain ascii and ünïcödé")


def test_a_traceback_keeps_its_lines_after_one_escaped_line() -> None:
    try:
        raise ValueError("bad\x1b[2J")
    except ValueError:
        text = _format("request %s failed", "r\n1", exc_info=sys.exc_info())
    first, *rest = text.split("\n")
    assert first.endswith("request r\\n1 failed")
    assert rest[0] == "Traceback (most recent call last):"
    assert rest[-1] == "ValueError: bad\\x1b[2J"  # the escape sequence made inert
    assert len(rest) > 2


def test_setup_logging_routes_every_logger_through_it() -> None:
    """In a fresh process, as a service's `run` does: ours and a library's records alike."""
    script = textwrap.dedent(
        """
        import argparse, logging
        from mili import flags
        flags.setup_logging(argparse.Namespace(log_level="INFO"))
        logging.getLogger("mili.frontend").info("%s done", "id\\nFORGED")
        logging.getLogger("grpc._cython.cygrpc").warning("peer %s", "x\\ry")
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    lines = run.stderr.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].endswith("INFO mili.frontend: id\\nFORGED done")
    assert lines[1].endswith("WARNING grpc._cython.cygrpc: peer x\\ry")
