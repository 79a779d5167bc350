"""A MILI service run as a real process, the way an operator starts it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

ROOT = Path(__file__).resolve().parent.parent
_LISTENING = re.compile(r"(\w+) service listening on (\S+)")
_HTTP = re.compile(r"(\w+) http on (\S+)")
_METRICS = re.compile(r" metrics on (\S+)")
_SERVE_HTTP = re.compile(r"OpenAI-compatible API on (\S+)/v1")  # `mili serve`'s summary


class ServiceProcess:
    """A MILI service started as `python -m mili COMMAND ...` on port 0, as an operator would.

    Its stdout announces the bound address; stderr (logs) is kept for assertions and failures.
    """

    def __init__(
        self,
        *args: str,
        timeout_s: float = 60.0,
        python_args: Sequence[str] = ("-m", "mili"),
        prefix: Sequence[str] = (),
    ) -> None:
        """`python_args` replace `-m mili` (e.g. `-c CODE` that wraps `mili.cli.main`);
        `prefix` runs it through another command that execs it, so that `proc` is still the
        service (e.g. `ip netns exec NS`, tests/netns.py)."""
        self.args = args
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, *python_args, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self.stderr_lines: list[str] = []
        self.stdout_lines: list[str] = []  # up to and including the listening line
        self._stderr_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr_reader.start()
        self.address = self._wait_for_address(timeout_s)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def _wait_for_address(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        timer = threading.Timer(timeout_s, self.proc.kill)
        timer.start()
        try:
            for line in self.proc.stdout:
                self.stdout_lines.append(line)
                match = _LISTENING.search(line)
                if match:
                    return match.group(2)
        finally:
            timer.cancel()
        self.proc.wait()
        self._stderr_reader.join(timeout=5)
        raise RuntimeError(
            f"mili {' '.join(self.args)} exited {self.proc.returncode} before listening:\n"
            + "".join(self.stderr_lines[-30:])
        )

    @property
    def http_url(self) -> str:
        """The frontend's HTTP API (`http://HOST:PORT`), announced before its gRPC port (by
        `mili serve`, in its summary)."""
        for line in self.stdout_lines:
            match = _HTTP.search(line)
            if match:
                return match.group(2)
            match = _SERVE_HTTP.search(line)
            if match:
                return match.group(1)
        raise AssertionError(f"mili {' '.join(self.args)} announced no HTTP port")

    @property
    def metrics_url(self) -> str:
        """Its Prometheus endpoint (`--metrics-port`), announced before its gRPC port."""
        for line in self.stdout_lines:
            match = _METRICS.search(line)
            if match:
                return match.group(1)
        raise AssertionError(f"mili {' '.join(self.args)} announced no metrics port")

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)

    def lines_matching(
        self, pattern: re.Pattern[str], count: int, *, start: int = 0, timeout_s: float = 10.0
    ) -> list[str]:
        """The stderr lines from line `start` on that match `pattern`, once there are `count`
        (the reader thread may be a moment behind the process: a sleep was a race)."""
        deadline = time.monotonic() + timeout_s
        while True:
            lines = [line for line in self.stderr_lines[start:] if pattern.search(line)]
            if len(lines) >= count or time.monotonic() > deadline:
                return lines
            time.sleep(0.02)

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (graceful drain), then wait; returns the exit code. `stderr` is then whole."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        self._stderr_reader.join(timeout=5)
        return code


def samples(metrics_url: str, name: str) -> Iterator[Sample]:
    """`name`'s samples on one process's /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        yield from (sample for sample in family.samples if sample.name == name)


def counted(metrics_url: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`, on one process's /metrics
    (0 when none is there yet)."""
    found = samples(metrics_url, name)
    return sum(sample.value for sample in found if labels.items() <= sample.labels.items())


def counted_by(metrics_url: str, name: str, label: str) -> Counter[str]:
    """`name`'s samples on one process's /metrics, summed by the value of their `label`."""
    counts: Counter[str] = Counter()
    for sample in samples(metrics_url, name):
        counts[sample.labels[label]] += int(sample.value)
    return counts
