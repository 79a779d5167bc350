"""Where a request's time to first token goes inside `mili serve`, from the services' own spans.

`mili serve --trace-console` prints every finished span; one request's spans (frontend, decode,
prefill, the KV transfer) share a trace. This serves the preset model, sends --requests
requests (--prompt-tokens each, --output-tokens out, --concurrency at a time) after --warmup
ones one at a time, then reads each request's milestones, in ms from the frontend's receipt of
its Generate, and prints their median and p90: which hop, queue or compute a TTFT is made of
(the Prometheus breakdown of serve_gpu.py has means per service, not the order within one
request). At concurrency 1 that is an idle system's TTFT; under load (serve_gpu.py's
saturated runs spend ~0.8 s between decode accepting a KV transfer and its commit, while
prefill's worker idles 44% of the time) it says which hop the requests queue at.

    python3 benchmarks/ttft_trace.py --device cuda --preset qwen3-0.6b
    python3 benchmarks/ttft_trace.py --device cuda --concurrency 64 --output-tokens 128 \
        --requests 128                                                   # under load
    python3 benchmarks/ttft_trace.py --device cpu --preset tiny --requests 5   # any machine
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.served, as a script

from benchmarks.presets import CHOICES, DEFAULT_CACHE, preset_checkpoint
from benchmarks.served import bench_args, mili_serve, run_bench, servable
from mili.client.bench_report import percentile

# (milestone, span name ("generate " a prefix: "generate <model>"), "start" | "end" | an event)
MILESTONES = [
    ("frontend asks decode to reserve", "mili.decode.v1.DecodeService/Generate", "start"),
    ("decode has the request", "/mili.decode.v1.DecodeService/Generate", "start"),
    ("frontend calls prefill", "mili.prefill.v1.PrefillService/Prefill", "start"),
    ("prefill has the prompt", "/mili.prefill.v1.PrefillService/Prefill", "start"),
    # these two race: prefill hands the prompt to its worker, then opens the stream to decode
    ("prefill compute starts", "prefill compute", "start"),
    ("prefill opens the KV transfer", "mili.kv.v1.KvTransferService/TransferKv", "start"),
    ("prefill compute ends", "prefill compute", "end"),
    ("decode has the KV (commit)", "/mili.kv.v1.KvTransferService/TransferKv", "end"),
    ("decode streams the first token", "decode request", "first token"),
    ("frontend has the first token", "generate ", "first token"),
]
ROOT = "/mili.frontend.v1.GenerationService/Generate"  # the frontend's server span: time 0
_LINE = re.compile(r"\[([\w-]+)\] (.*)")


def spans_of(log: str) -> list[dict[str, Any]]:
    """The JSON spans the children printed, each line prefixed with "[child] " by the launcher."""
    spans: list[dict[str, Any]] = []
    open_blocks: dict[str, list[str]] = collections.defaultdict(list)  # child -> its span's lines
    for line in log.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        child, text = m.groups()
        block = open_blocks[child]
        if text == "{":
            block[:] = ["{"]
        elif block:
            block.append(text)
            if text == "}":
                # a log line of the same child landing inside a span's lines (stdout and stderr
                # share its prefix) spoils that span alone: its request then lacks a milestone
                with contextlib.suppress(json.JSONDecodeError):
                    spans.append(json.loads("\n".join(block)))
                block.clear()
    return spans


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def milestones(trace: list[dict[str, Any]]) -> dict[str, float]:
    """A request's milestones, ms from its frontend Generate's start (the trace has one)."""
    t0 = next(_seconds(s["start_time"]) for s in trace if s["name"] == ROOT)
    found = {}
    for label, name, when in MILESTONES:
        for span in trace:  # "mili..." a client's span, "/mili..." a server's
            is_named = span["name"].startswith(name) if name.endswith(" ") else span["name"] == name
            if not is_named:
                continue
            if when in ("start", "end"):
                found[label] = (_seconds(span[f"{when}_time"]) - t0) * 1e3
            else:
                times = [e["timestamp"] for e in span.get("events", []) if e["name"] == when]
                if times:
                    found[label] = (_seconds(times[0]) - t0) * 1e3
            break
    return found


def timelines(log: str, skip: int) -> list[dict[str, float]]:
    """Each traced request's milestones in the order they came, the first `skip` dropped."""
    traces: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for span in spans_of(log):
        traces[span["context"]["trace_id"]].append(span)
    ordered = sorted(
        (t for t in traces.values() if any(s["name"] == ROOT for s in t)),
        key=lambda t: min(_seconds(s["start_time"]) for s in t),
    )
    return [milestones(t) for t in ordered[skip:]]


def report(rows: list[dict[str, float]]) -> list[str]:
    lines = [f"{'milestone (ms from the frontend receiving Generate)':52} {'p50':>8} {'p90':>8}"]
    for label, _, _ in MILESTONES:
        values = [r[label] for r in rows if label in r]
        p50, p90 = percentile(values, 50), percentile(values, 90)  # as mili bench computes them
        if p50 is None or p90 is None:
            lines.append(f"{label:52} {'-':>8} {'-':>8}")
            continue
        lines.append(f"{label:52} {p50:8.2f} {p90:8.2f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="qwen3-0.6b", choices=CHOICES)
    parser.add_argument("--attention", default="auto", choices=["auto", "mojo", "torch"])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--output-tokens", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()

    weights = preset_checkpoint(args.preset, args.cache_dir)
    extra = ["--device", args.device, "--trace-console"]
    with (
        servable(weights) as model_dir,
        mili_serve(model_dir, "bfloat16", 4, args.attention, extra) as s,
    ):
        run_bench(bench_args(s.address, 1, args.warmup, args.prompt_tokens, 2, seed=99))
        run_bench(
            bench_args(
                s.address, args.concurrency, args.requests, args.prompt_tokens, args.output_tokens
            )
        )
        s.proc.terminate()  # the spans still buffered are printed as the children stop
        s.proc.wait(90)
        s.log.seek(0)
        log = s.log.read()
    rows = timelines(log, skip=args.warmup)
    print(
        f"{len(rows)} requests, {args.prompt_tokens}-token prompts, {args.output_tokens} out, "
        f"concurrency {args.concurrency}, {args.device}, {args.preset}"
    )
    print("\n".join(report(rows)), flush=True)
    partial = sum(len(r) < len(MILESTONES) for r in rows)
    if partial:  # their medians would mix requests: say so, and fail
        print(f"{partial} requests lack a milestone (a span not printed or not parsed)")
    return 0 if len(rows) == args.requests and not partial else 1


if __name__ == "__main__":
    sys.exit(main())
