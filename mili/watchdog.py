"""A stalled engine thread stops its process: prefill's worker or decode's batch loop stuck in a
step that never returns (a kernel that never finishes, a driver fault, a deadlock) leaves the
process answering health, liveness and Info while every request on it waits for good.

The engine thread reports to a `Progress` as it goes (busy: its current work began or moved on
at this time; idle: waiting for work); a `Watchdog` thread reads it and, once the thread has
been busy for `timeout_s` without moving on, calls `on_stall` once with what it was doing. The
services log it and exit (mili serve or Kubernetes then starts a fresh instance), as SGLang's
watchdog does; a drain would wait on the stuck step's calls first.

Torch-free and pure threading, so it is tested with a plain thread that stops moving.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

_LOG = logging.getLogger("mili.watchdog")
CHECKS_PER_TIMEOUT = 10


class Progress:
    """What an engine thread is doing, written by that thread alone, read by the watchdog."""

    def __init__(self) -> None:
        # (monotonic time the current work began or last moved on, what it is), None: idle.
        # One tuple, replaced whole: the watchdog never reads a time with another's label.
        self._busy: tuple[float, str] | None = None

    def busy(self, what: str) -> None:
        """The thread starts (or moves on to) `what`, e.g. "a decode step of 64 requests"."""
        self._busy = (time.monotonic(), what)

    def idle(self) -> None:
        """The thread waits for work: not a stall however long it lasts."""
        self._busy = None

    def stalled(self, now: float) -> tuple[float, str] | None:
        """(seconds busy without moving on, doing what), or None while idle."""
        busy = self._busy
        return None if busy is None else (now - busy[0], busy[1])


class Watchdog:
    """Calls `on_stall(message)` once when `progress` has been busy `timeout_s` without moving
    on; checks CHECKS_PER_TIMEOUT times a timeout (so it fires within 1/CHECKS_PER_TIMEOUT of a
    timeout late). `name` is the service's, for the message."""

    def __init__(
        self,
        progress: Progress,
        timeout_s: float,
        on_stall: Callable[[str], None],
        name: str,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be > 0 s, got {timeout_s}")
        self._progress = progress
        self._timeout_s = timeout_s
        self._on_stall = on_stall
        self._name = name
        self._interval_s = timeout_s / CHECKS_PER_TIMEOUT
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            stalled = self._progress.stalled(time.monotonic())
            if stalled is not None and stalled[0] >= self._timeout_s:
                seconds, what = stalled
                self._on_stall(
                    f"{self._name}: {what} has made no progress for {seconds:.0f} s "
                    f"(--watchdog-timeout {self._timeout_s:g}): the engine thread is stuck"
                )
                return


def exit_on_stall(message: str) -> None:
    """A service's `on_stall`: log why, then exit 1 at once. Not a drain: the stuck step's
    calls would hold it to its timeout, and the thread can be neither joined nor stopped;
    callers see their connection end (UNAVAILABLE) and retry elsewhere."""
    _LOG.critical("%s: exiting (exit status 1) for a fresh instance to take over", message)
    logging.shutdown()  # flush the line: os._exit skips every handler
    os._exit(1)


def watch(progress: Progress, timeout_s: float, name: str) -> Watchdog | None:
    """Start the watchdog of a service's engine thread, exiting on a stall (None: timeout 0,
    watching off)."""
    if timeout_s == 0:
        return None
    watchdog = Watchdog(progress, timeout_s, exit_on_stall, name)
    watchdog.start()
    return watchdog
