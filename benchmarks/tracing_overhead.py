"""Tracing overhead: `mili bench` throughput with tracing on (100% sampling) vs off.

Two `mili serve` deployments of the embedded demo model run side by side: one with no tracing,
one with `--otlp-endpoint` pointed at an OTLP/gRPC receiver in this process (it counts spans and
drops them) and OTEL_TRACES_SAMPLER=always_on. --rounds rounds alternate the same `mili bench`
load (token-id prompts, ignore_eos, temperature 0) against each, off first, so the machine's
other load hits both alike. Reported: output tokens/s per round, medians, and
ratio = median(on) / median(off). Target: >= 0.95 (within 5%).

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="OMP/MKL threads per child")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    receiver = _CountingReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    threads = str(args.threads)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    common = ["--prefill-args", "--num-blocks 1024", "--decode-args", "--num-blocks 2048"]
    tmp = Path(tempfile.mkdtemp(prefix="mili-tracing-bench-"))
    off = _Serve(common, env, tmp / "off.log")
    on = _Serve(
        [*common, "--otlp-endpoint", f"http://127.0.0.1:{port}"],
        {**env, "OTEL_TRACES_SAMPLER": "always_on"},
        tmp / "on.log",
    )
    rates: dict[str, list[float]] = {"off": [], "on": []}
    try:
        _bench(off.address, args, tmp / "warm.json")  # first-call costs out of the rounds
        _bench(on.address, args, tmp / "warm.json")
        for i in range(args.rounds):
            for name, serve in (("off", off), ("on", on)):
                rates[name].append(_bench(serve.address, args, tmp / f"{name}-{i}.json"))
            print(
                f"round {i}: off {rates['off'][-1]:.1f} tok/s, on {rates['on'][-1]:.1f} tok/s",
                flush=True,
            )
    finally:
        codes = [off.stop(), on.stop()]
        server.stop(1)
    median_off = statistics.median(rates["off"])
    median_on = statistics.median(rates["on"])
    ratio = median_on / median_off
    print(
        f"tracing off {median_off:.1f} tok/s, on {median_on:.1f} tok/s (median of {args.rounds}); "
        f"ratio on/off {ratio:.3f} (target >= 0.95); {receiver.num_spans} spans received; "
        f"exit codes {codes}"
    )
    if args.json is not None:
        result = {"rates": rates, "median_off": median_off, "median_on": median_on}
        result |= {"ratio": ratio, "num_spans": receiver.num_spans, "config": vars(args)}
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
