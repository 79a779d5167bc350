"""Tracing overhead: `mili bench` throughput with tracing on (100% sampling) vs off.

Two `mili serve` deployments of the embedded demo model run side by side: one with no tracing,
one with `--otlp-endpoint` pointed at an OTLP/gRPC receiver in this process (it counts spans and
drops them) and OTEL_TRACES_SAMPLER=always_on. --rounds rounds alternate the same `mili bench`
load (token-id prompts, ignore_eos, temperature 0; no prefix caching, so each round computes
every prompt) against each, the order flipping every round
(off/on, on/off, ...) so drift and the machine's other load hit both alike. Reported per round:
output tokens/s of each and their ratio; overall the median of the per-round ratios on/off
(target >= 0.95: within 5%), and the CPU seconds the four service processes of each deployment
spent per output token (user + system from /proc, over all rounds): a second view of the cost
that a noisy shared host disturbs less than throughput.

Others benchmark on the same machine: run it under the shared lock, e.g.

    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/tracing_overhead.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
_LISTENING = re.compile(r"frontend service listening on (\S+)")


class _CountingReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.num_spans = 0
        self._lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.num_spans += n
        return trace_service_pb2.ExportTraceServiceResponse()


class _Serve:
    """`mili serve` on free ports; its logs go to a file (kept on failure)."""

    def __init__(self, extra: list[str], env: dict[str, str], log: Path) -> None:
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mili", "serve", "--port", "0", *extra],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            match = _LISTENING.search(line)
            if match:
                self.address = match.group(1)
                break
        else:
            raise RuntimeError(f"mili serve exited {self.proc.wait()}; see {log}")
        # Keep draining stdout so the child never blocks on a full pipe.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=120)
        self._log.close()
        return code


def _cpu_seconds(root_pid: int) -> float:
    """User + system CPU seconds of `root_pid` and all its descendants (Linux /proc)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    family, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parents.items() if p == pid and c not in family]
        family.update(children)
        frontier.extend(children)
    return sum(times.get(pid, 0.0) for pid in family)


def _bench(address: str, args: argparse.Namespace, out: Path) -> float:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "mili",
            "bench",
            "--address",
            address,
            "--concurrency",
            str(args.concurrency),
            "--num-requests",
            str(args.num_requests),
            "--prompt-tokens",
            str(args.prompt_tokens),
            "--output-tokens",
            str(args.output_tokens),
            "--json",
            str(out),
        ],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    summary = json.loads(out.read_text())
    if summary["num_errors"]:
        raise RuntimeError(f"bench errors: {summary['errors']}")
    return float(summary["output_tokens_per_s"])


def _tokens(args: argparse.Namespace) -> int:
    return args.num_requests * args.output_tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per child")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    receiver = _CountingReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    threads = str(args.threads)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    # Every round sends the same prompts: without --no-prefix-cache all rounds after the first
    # would prefill them from the cache (less work per token, so tracing's share looks larger).
    common = ["--no-prefix-cache", "--prefill-args", "--num-blocks 1024"]
    common += ["--decode-args", "--num-blocks 2048"]
    tmp = Path(tempfile.mkdtemp(prefix="mili-tracing-bench-"))
    off = _Serve(common, env, tmp / "off.log")
    on = _Serve(
        [*common, "--otlp-endpoint", f"http://127.0.0.1:{port}"],
        {**env, "OTEL_TRACES_SAMPLER": "always_on"},
        tmp / "on.log",
    )
    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpu = {"off": 0.0, "on": 0.0}
    serves = {"off": off, "on": on}
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    try:
        _bench(off.address, args, tmp / "warm.json")  # first-call costs out of the rounds
        _bench(on.address, args, tmp / "warm.json")
        for i in range(args.rounds):
            for name in ("off", "on") if i % 2 == 0 else ("on", "off"):
                before = _cpu_seconds(serves[name].proc.pid)
                rates[name].append(_bench(serves[name].address, args, tmp / f"{name}-{i}.json"))
                cpu[name] += _cpu_seconds(serves[name].proc.pid) - before
            print(
                f"round {i}: off {rates['off'][-1]:.1f} tok/s, on {rates['on'][-1]:.1f} tok/s, "
                f"on/off {rates['on'][-1] / rates['off'][-1]:.3f}",
                flush=True,
            )
    finally:
        codes = [off.stop(), on.stop()]
        server.stop(1)
    ratios = [x / y for x, y in zip(rates["on"], rates["off"], strict=True)]  # on / off
    ratio = statistics.median(ratios)
    tokens = _tokens(args) * args.rounds
    cpu_ms = {name: 1e3 * seconds / tokens for name, seconds in cpu.items()}
    print(
        f"tracing off {statistics.median(rates['off']):.1f} tok/s, on "
        f"{statistics.median(rates['on']):.1f} tok/s (medians of {args.rounds}); median of the "
        f"per-round ratios on/off {ratio:.3f} (target >= 0.95)\n"
        f"service CPU per output token: off {cpu_ms['off']:.2f} ms, on {cpu_ms['on']:.2f} ms "
        f"(on/off {cpu_ms['on'] / cpu_ms['off']:.3f}); {receiver.num_spans} spans received; "
        f"exit codes {codes}; load average {os.getloadavg()[0]:.2f}"
    )
    if args.json is not None:
        result = {"rates": rates, "ratios": ratios, "ratio": ratio, "cpu_ms_per_token": cpu_ms}
        result |= {"num_spans": receiver.num_spans, "config": vars(args)}
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
