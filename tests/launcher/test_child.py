"""A `mili serve` child's bookkeeping: the log ring of its current run, its pinned address."""

from __future__ import annotations

import asyncio
import re

import pytest

from mili.serve.child import _LINE_LIMIT, Child, LogTail, describe_exit


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


def test_a_line_over_the_limit_is_cut_and_forwarding_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A child's log line of over 1 MiB (a huge field logged at DEBUG): asyncio's readline
    raises ValueError, which once ended forwarding for good (the child then blocks on a full
    pipe) and broke `mili serve`'s shutdown. Now it is cut and the next lines go on."""
    child = Child("frontend", ["serve-frontend"])

    async def main() -> None:
        reader = asyncio.StreamReader(limit=_LINE_LIMIT)
        reader.feed_data(b"before\n" + b"x" * (2 * _LINE_LIMIT) + b"\nafter\n")
        reader.feed_eof()
        await asyncio.wait_for(child._forward(reader, None), 10)

    asyncio.run(main())
    lines = [line.split(" ", 1)[1] for line in child.tail.format(indent="").splitlines()]
    assert lines[0] == "before" and lines[-1] == "after"
    assert any("was cut here" in line for line in lines)
    assert "[frontend] after" in capsys.readouterr().err


def test_a_watcher_cancelled_while_draining_leaves_the_readers_to_stop() -> None:
    """A watcher cancelled inside `_drain_readers` (mili serve stopping) once cancelled the
    readers with it; `stop` then drained them again and got their CancelledError, which a
    review's cut of the suppress let through as a traceback and exit 1 (a CI run's serve
    benchmark). The cancel reaches the watcher; the readers read on, and `stop` finishes."""
    child = Child("frontend", ["serve-frontend"])

    async def main() -> None:
        reader = asyncio.StreamReader(limit=_LINE_LIMIT)
        child._readers = [asyncio.create_task(child._forward(reader, None))]
        watcher = asyncio.create_task(child._drain_readers())
        await asyncio.sleep(0.05)
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher
        assert not child._readers[0].done()  # still reading
        reader.feed_data(b"last line\n")
        reader.feed_eof()
        await asyncio.wait_for(child._drain_readers(), 5)  # what stop() does next
        assert child._readers[0].done() and not child._readers[0].cancelled()

    asyncio.run(main())
    assert "last line" in child.tail.format(indent="")


def test_readers_held_open_past_two_seconds_are_cancelled() -> None:
    child = Child("frontend", ["serve-frontend"])

    async def main() -> None:
        reader = asyncio.StreamReader(limit=_LINE_LIMIT)  # a grandchild keeps it open
        child._readers = [asyncio.create_task(child._forward(reader, None))]
        await asyncio.wait_for(child._drain_readers(), 5)
        await asyncio.sleep(0)
        assert child._readers[0].cancelled()

    asyncio.run(main())
