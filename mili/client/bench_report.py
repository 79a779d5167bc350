"""`mili bench`'s numbers: each request's result, the run's progress line, the summary's
percentiles and grouped errors, and the report printed at the end."""

from __future__ import annotations

import math
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mili.plural import plural

LATE_S = 0.001  # an open-loop request a client took more than this after its arrival: late
KV_NOTE = (
    "not measurable from a client: KV moves prefill -> decode directly; the frontend logs "
    "each request's KV bytes, transfer ms and GB/s"
)


@dataclass
class RequestResult:
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    error: str | None = None
    num_retries: int = 0  # sends again after RESOURCE_EXHAUSTED with RetryInfo
    late_s: float = 0.0  # open loop: from its arrival to a client taking it (none was free)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99, max and mean, in milliseconds. The max is the one stall p99 hides: a
    handful of long gaps among thousands (a preempted request's recompute between steps)."""
    out: dict[str, float | None] = {}
    for q in (50, 90, 99):
        v = percentile(values, q)
        out[f"p{q}_ms"] = None if v is None else v * 1e3
    out["max_ms"] = max(values) * 1e3 if values else None
    out["mean_ms"] = sum(values) / len(values) * 1e3 if values else None
    return out


class Progress:
    """Prints `done/total, errors, tokens/s` to stderr at every `step` of the requests and at
    least every `interval_s` (from `tick`, which the caller runs on a timer)."""

    def __init__(self, num_total: int, *, step: float = 0.1, interval_s: float = 5.0) -> None:
        self.num_total = num_total
        self.num_done = 0
        self.num_errors = 0
        self.num_tokens = 0
        self._every = max(1, math.ceil(num_total * step))  # requests between two lines
        self._interval_s = interval_s
        self.start()
        self._printed_done = 0

    def start(self) -> None:
        """The run's clock starts now (the clients are connected)."""
        self._started = time.perf_counter()
        self._printed_at = self._started

    def record(self, result: RequestResult) -> None:
        self.num_done += 1
        if result.error is not None:
            self.num_errors += 1
        self.num_tokens += result.num_completion_tokens
        if self.num_done - self._printed_done >= self._every or self.num_done == self.num_total:
            self._print()

    def tick(self) -> None:
        if time.perf_counter() - self._printed_at >= self._interval_s:
            self._print()

    def _print(self) -> None:
        now = time.perf_counter()
        elapsed = now - self._started
        rate = self.num_tokens / elapsed if elapsed > 0 else 0.0
        print(
            f"mili bench: {self.num_done}/{self.num_total} done, "
            f"{plural(self.num_errors, 'error')}, "
            f"{rate:.1f} output tokens/s, {elapsed:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        self._printed_at = now
        self._printed_done = self.num_done


CLIENT_BUSY_PERCENT = 90.0  # a client process's CPU, % of one core, that the report flags

# What one request's error says of itself alone, masked so that one cause is one group: an
# address (which instance) is kept, in gRPC's own spelling too (`ipv4:127.0.0.1:50051`,
# `ipv6:%5B::1%5D:50051`: tried before host:port, which would take `ipv4:127` for one); the id
# the frontend minted (`(id 3f9a0c1b2d4e-17.1)`, as services name a request) and any other id
# of hex digits (a uuid) become *, any other number # (a token id, a count, our bench-N ids, a
# duration).
_DETAIL = re.compile(
    r"(?P<minted>\(id [^)\s]+\))|"
    r"(?P<address>\b(?:ipv4:)?(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?"
    r"|(?:\bipv6:)?(?:\[|%5B)[0-9A-Fa-f:.]+(?:\]|%5D):\d+"
    r"|\b[A-Za-z][\w.-]*:\d+\b(?![.\d]))"
    r"|(?P<hex>\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{8,}\b)"
    r"|(?P<number>\d+)"
)
MAX_SHOWN_GROUPS = 10  # error lines in the report; the JSON has every group
MAX_SHOWN_CHARS = 300  # of an example message in the report


def _masked(match: re.Match[str]) -> str:
    if match["minted"] is not None:
        return "(id *)"
    if match["address"] is not None:
        return match["address"]
    return "*" if match["hex"] is not None else "#"


def cause(error: str) -> str:
    """`error` with what is particular to its request masked (ids, numbers; addresses kept),
    and a part that repeats once masked said once: a status's field violations, one per bad
    token id, read `token_ids[#]: outside the vocabulary (ids #..#) (got #)` however many."""
    code, colon, message = _DETAIL.sub(_masked, error).partition(": ")  # the status's name
    return code + colon + "; ".join(dict.fromkeys(message.split("; ")))


def group_errors(errors: list[str]) -> list[dict[str, Any]]:
    """Failed requests grouped by `cause`, most frequent first: each group's cause, count and
    one example (the first error of that cause, as it was)."""
    counts: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for error in errors:
        key = cause(error)
        counts[key] += 1
        examples.setdefault(key, error)
    ordered = sorted(counts.items(), key=lambda x: (-x[1], x[0]))
    return [{"cause": key, "count": n, "error": examples[key]} for key, n in ordered]


def _error_lines(groups: list[dict[str, Any]]) -> list[str]:
    """The largest groups' count and example, each example cut at MAX_SHOWN_CHARS, and one
    line for the rest: a run whose every request failed differently stays a few lines."""
    lines = []
    for group in groups[:MAX_SHOWN_GROUPS]:
        error = group["error"]
        if len(error) > MAX_SHOWN_CHARS:
            error = f"{error[:MAX_SHOWN_CHARS]}... ({len(error)} characters)"
        lines.append(f"error      {group['count']} x {error}")
    rest = groups[MAX_SHOWN_GROUPS:]
    if rest:
        num_requests = plural(sum(g["count"] for g in rest), "request")
        more = plural(len(rest), "more cause")
        lines.append(f"error      {more} ({num_requests}); --json lists every one")
    return lines


def _fmt(value: object) -> str:
    return "-" if value is None else f"{value:.2f}"


def _client_line(cpu_percent: list[float]) -> str:
    """The client processes' CPU over the run, % of one core each: one near a whole core
    reads no faster, so the run may have measured the client."""
    low, high = min(cpu_percent), max(cpu_percent)
    spread = f"{high:.0f}%" if round(low) == round(high) else f"{low:.0f}-{high:.0f}%"
    n = len(cpu_percent)
    line = f"client     {plural(n, 'process', 'processes')}, {spread} of a core"
    if n > 1:
        line += " each"
    if high >= CLIENT_BUSY_PERCENT:
        line += " (near a whole core: the client may be what limits this run; --processes)"
    return line


def report(summary: dict[str, Any]) -> str:
    lines = [
        f"requests   {summary['num_ok']} ok, {summary['num_errors']} failed "
        f"in {summary['wall_s']:.2f} s",
        f"output     {summary['output_tokens_per_s']:.1f} tokens/s, "
        f"{summary['requests_per_s']:.2f} requests/s",
    ]
    for name in ("ttft", "itl", "latency"):
        stats = summary[name]
        assert isinstance(stats, dict)
        lines.append(
            f"{name:<10} p50 {_fmt(stats['p50_ms'])} ms, p90 {_fmt(stats['p90_ms'])} ms, "
            f"p99 {_fmt(stats['p99_ms'])} ms, max {_fmt(stats['max_ms'])} ms"
        )
    rate = summary["config"]["request_rate"]
    if rate is not None:
        late = summary["late"]
        sent = f"{summary['num_sent_late']} sent late"
        if summary["num_sent_late"]:
            late_ms = f"p50 {_fmt(late['p50_ms'])} ms, max {_fmt(late['max_ms'])} ms"
            sent += f" (every client busy; {late_ms})"
        lines.append(f"arrivals   {rate:g}/s (Poisson, open loop), {sent}")
    lines.append(f"KV GB/s    {KV_NOTE}")
    lines.append(_client_line(summary["client_cpu_percent"]))
    if summary["num_retries"]:
        lines.append(
            f"retries    {summary['num_retries']} (of "
            f"{plural(summary['num_retried_requests'], 'request')} refused RESOURCE_EXHAUSTED "
            "with RetryInfo, sent again after its delay)"
        )
    for skip in summary["skipped_addresses"]:
        lines.append(f"skipped    {skip['address']}: {skip['error']}")
    lines.extend(_error_lines(summary["errors"]))
    return "\n".join(lines)
