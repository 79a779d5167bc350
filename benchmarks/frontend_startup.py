"""Frontend start-up: seconds until `frontend service listening`, and the process's peak RSS.

The frontend holds no model, so what it costs to start is its imports. Each run starts
`python -m mili serve-frontend --port 0` with unreachable tokenizer/prefill/decode addresses
(it listens anyway and polls them), times Popen -> the "listening" line, checks its health
(once it answers, its signal handlers are installed), sends SIGTERM, and reads the child's
peak RSS (ru_maxrss) and CPU seconds (user + system, start to exit: less disturbed by other
load on a shared host than wall time) from wait4; the child reports at exit whether torch was
ever imported.
Several source trees can be compared (e.g. a checkout of main and this branch): runs alternate
between them so the machine's other load hits each alike; reported per tree are the median
and min seconds to listening, the median CPU seconds and the median peak RSS.

    git archive main | tar -x -C /tmp/main-tree
    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/frontend_startup.py \\
        --tree /tmp/main-tree --tree . --runs 10
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent

# `python -m mili`, plus a line on stderr at exit saying whether torch was ever imported.
_MAIN = """\
import atexit, sys
atexit.register(lambda: print("torch loaded:", "torch" in sys.modules, file=sys.stderr))
from mili.cli import main
sys.exit(main(sys.argv[1:]))
"""
_ARGS = ["serve-frontend", "--port", "0", "--tokenizer", "127.0.0.1:1"]
_ARGS += ["--prefill", "127.0.0.1:2", "--decode", "127.0.0.1:3", "--log-level", "WARNING"]


class Run(NamedTuple):
    seconds: float  # Popen -> "listening"
    cpu_s: float  # user + system, whole process life
    rss_bytes: int  # peak
    is_torch_loaded: bool


def one_run(tree: Path) -> Run:
    """One frontend started in `tree`, timed until listening, then stopped."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tree)}
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", _MAIN, *_ARGS],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    for line in proc.stdout:
        if "frontend service listening on" in line:
            break
    else:
        raise RuntimeError(f"frontend in {tree} exited before listening: {proc.stderr.read()}")
    seconds = time.perf_counter() - started
    address = line.rsplit(" ", 1)[1].strip()
    with grpc.insecure_channel(address) as channel:  # answered: it now drains on SIGTERM
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    proc.send_signal(signal.SIGTERM)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen from waiting
    stderr = proc.stderr.read()
    if proc.returncode != 0:
        raise RuntimeError(f"frontend in {tree} exited {proc.returncode}: {stderr}")
    cpu_s = usage.ru_utime + usage.ru_stime
    return Run(seconds, cpu_s, usage.ru_maxrss * 1024, "torch loaded: True" in stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tree", type=Path, action="append", help="source tree to run (repeat; default: this one)"
    )
    parser.add_argument("--runs", type=int, default=10, help="runs per tree (default: 10)")
    args = parser.parse_args()
    trees = [t.resolve() for t in args.tree or [ROOT]]
    print(f"load average {os.getloadavg()[0]:.1f}; python {sys.executable}", flush=True)
    one_run(trees[0])  # warm the page cache (first import of grpc, protobuf, torch from disk)
    results: dict[Path, list[Run]] = {t: [] for t in trees}
    for i in range(args.runs):
        for tree in trees if i % 2 == 0 else trees[::-1]:
            results[tree].append(one_run(tree))
    print("| tree | torch loaded | to listening, median s | min s | CPU s | peak RSS, MiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for tree, runs in results.items():
        loaded = {r.is_torch_loaded for r in runs}
        seconds = [r.seconds for r in runs]
        print(
            f"| {tree} | {'yes' if loaded == {True} else 'no' if loaded == {False} else 'some'} "
            f"| {statistics.median(seconds):.2f} | {min(seconds):.2f} "
            f"| {statistics.median(r.cpu_s for r in runs):.2f} "
            f"| {statistics.median(r.rss_bytes for r in runs) / 2**20:.0f} |"
        )
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
