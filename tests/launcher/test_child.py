"""A `mili serve` child's bookkeeping: the log ring of its current run, its pinned address."""

from __future__ import annotations

import re

from mili.serve.child import Child, LogTail, describe_exit


def test_log_tail_keeps_the_last_lines_with_their_time() -> None:
    tail = LogTail(max_lines=3)
    for i in range(5):
        tail.append(f"line {i}")
    lines = tail.format(indent="  ").splitlines()
    assert [line.split(" ", 3)[-1] for line in lines] == ["line 2", "line 3", "line 4"]
    assert all(re.fullmatch(r"  \d\d:\d\d:\d\d\.\d{3} line \d", line) for line in lines)
    tail.clear()  # a restart: nothing of the previous run is shown again
    assert len(tail) == 0 and tail.format() == "    (no output)"


def test_restarts_pin_the_first_runs_ports() -> None:
    child = Child("decode-0", ["serve-decode", "--port", "0", "--metrics-port", "0"])
    assert child.command() == child.argv
    child.address = "127.0.0.1:41235"
    child.metrics_url = "http://127.0.0.1:9107/metrics"
    # Last on the line: argparse keeps the last value of a repeated flag.
    assert child.command()[-4:] == ["--port", "41235", "--metrics-port", "9107"]
    ipv6 = Child("tokenizer", ["serve-tokenizer"])
    ipv6.address = "[::1]:50052"
    assert ipv6.command() == ["serve-tokenizer", "--port", "50052"]


def test_exit_codes_name_their_signal() -> None:
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(-9) == "exited with code -9 (SIGKILL)"
