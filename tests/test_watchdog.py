"""The engine threads' watchdog (mili/watchdog.py): a thread that stops moving on while busy is
reported once, with what it was doing; one that moves on or waits for work never is; a service
exits 1 on it, saying why."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mili.watchdog import Progress, Watchdog

ROOT = Path(__file__).resolve().parents[1]


def _watch(progress: Progress, timeout_s: float) -> tuple[Watchdog, list[str]]:
    stalls: list[str] = []
    watchdog = Watchdog(progress, timeout_s, stalls.append, "decode")
    watchdog.start()
    return watchdog, stalls


def test_a_thread_stuck_in_its_work_is_reported_once_naming_it() -> None:
    progress = Progress()
    release = threading.Event()

    def engine() -> None:
        progress.busy("a decode step of 3 requests")
        release.wait(10)  # the stuck step

    thread = threading.Thread(target=engine)
    thread.start()
    watchdog, stalls = _watch(progress, 0.3)
    try:
        deadline = time.monotonic() + 5
        while not stalls and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # a second report would come within this
        assert len(stalls) == 1
        assert stalls[0].startswith("decode: a decode step of 3 requests has made no progress")
        assert "--watchdog-timeout 0.3" in stalls[0]
    finally:
        release.set()
        thread.join()
        watchdog.stop()


@pytest.mark.parametrize("kind", ["moving on", "idle"])
def test_a_thread_moving_on_or_waiting_for_work_is_never_reported(kind: str) -> None:
    progress = Progress()
    stop = threading.Event()

    def engine() -> None:
        while not stop.is_set():
            if kind == "moving on":
                progress.busy("a decode step of 1 request")
                time.sleep(0.01)
            else:
                progress.idle()
                stop.wait(5)  # waiting for work far past the timeout

    thread = threading.Thread(target=engine)
    thread.start()
    watchdog, stalls = _watch(progress, 0.5)
    time.sleep(1.5)
    stop.set()
    thread.join()
    watchdog.stop()
    assert stalls == []


def test_zero_or_less_is_no_timeout() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        Watchdog(Progress(), 0, print, "decode")


def test_a_service_exits_1_saying_why() -> None:
    """`watch`'s reaction, in a process of its own: the critical line, then exit status 1
    at once (the stuck thread is never joined)."""
    script = (
        "import threading, time\n"
        "from mili.watchdog import Progress, watch\n"
        "progress = Progress()\n"
        "progress.busy('a prefill step of 2048 tokens')\n"
        "watch(progress, 0.2, 'prefill')\n"
        "time.sleep(30)\n"
    )
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 1
    assert time.monotonic() - started < 20
    assert "prefill: a prefill step of 2048 tokens has made no progress" in result.stderr
    assert "exiting (exit status 1)" in result.stderr
