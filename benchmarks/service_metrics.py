"""Where a request's time goes inside `mili serve`, from the services' own Prometheus metrics.

`snapshot` scrapes every child's /metrics (`mili_serve(..., metrics=True)` gives their URLs);
`breakdown` turns two snapshots, before and after a run, into the means of the histograms below
over that run (sum delta / count delta, with the count) and each child's CPU use (its
process_cpu_seconds_total delta over the run's wall time); `lines` prints it. A child that did
not answer, or a metric it lacks, gives None (printed `-`): the benchmark's own numbers matter
more than this.
"""

from __future__ import annotations

import contextlib
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# (JSON key, histogram, printed label): the key's first word is the child kind; a key ending in
# _ms is a histogram of seconds, printed in ms.
HISTOGRAMS = [
    ("prefill_batch_size", "mili_prefill_batch_size", "batch"),
    ("prefill_batch_tokens", "mili_prefill_batch_tokens", "tokens"),
    ("prefill_step_ms", "mili_prefill_step_seconds", "step"),
    ("prefill_kv_transfer_ms", "mili_prefill_kv_transfer_seconds", "KV"),
    ("decode_batch_size", "mili_decode_batch_size", "batch"),
    ("decode_step_ms", "mili_decode_step_seconds", "step"),
    ("decode_kv_transfer_ms", "mili_decode_kv_transfer_seconds", "KV"),
    ("frontend_queue_wait_ms", "mili_frontend_queue_wait_seconds", "queue"),
    ("frontend_ttft_ms", "mili_frontend_time_to_first_token_seconds", "TTFT"),
]
Snapshot = dict[str, dict[str, float]]  # child name -> unlabelled sample name -> value


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """The unlabelled samples of one /metrics page; {} if it does not answer."""
    with contextlib.suppress(Exception), urllib.request.urlopen(url, timeout=timeout_s) as r:
        text = r.read().decode()
        families = text_string_to_metric_families(text)
        return {s.name: s.value for f in families for s in f.samples if not s.labels}
    return {}


def snapshot(urls: dict[str, str]) -> Snapshot:
    return {name: scrape(url) for name, url in urls.items()}


def _delta(before: Snapshot, after: Snapshot, kind: str, sample: str) -> float | None:
    """after - before of `sample`, summed over the children of `kind` (prefill-0, prefill-1)."""
    found = [
        values[sample] - before.get(child, {}).get(sample, 0.0)
        for child, values in after.items()
        if child.split("-")[0] == kind and sample in values
    ]
    return sum(found) if found else None


def breakdown(before: Snapshot, after: Snapshot, wall_s: float) -> dict[str, Any]:
    """{key: {"mean", "count"}} per histogram, and "cpu_percent": {child: % of one core}."""
    result: dict[str, Any] = {}
    for key, name, _ in HISTOGRAMS:
        kind, scale = key.split("_")[0], 1e3 if key.endswith("_ms") else 1.0
        total = _delta(before, after, kind, f"{name}_sum")
        count = _delta(before, after, kind, f"{name}_count")
        mean = None if total is None or not count else round(total / count * scale, 4)
        result[key] = {"mean": mean, "count": None if count is None else int(count)}
    cpu = "process_cpu_seconds_total"
    result["cpu_percent"] = {
        child: round(100 * (values[cpu] - before[child][cpu]) / wall_s, 1)
        for child, values in after.items()
        if cpu in values and cpu in before.get(child, {}) and wall_s > 0
    }
    return result


def lines(result: dict[str, Any], prefix: str = "  breakdown: ") -> list[str]:
    """Two lines: prefill and frontend; decode and CPU. Means with counts (n), `-` if none."""

    def item(key: str, label: str) -> str:
        mean, count = result[key]["mean"], result[key]["count"]
        value = "-" if mean is None else f"{mean:.2f} ms" if key.endswith("_ms") else f"{mean:.1f}"
        return f"{label} {value} (n {'-' if count is None else count})"

    def group(kind: str) -> str:
        items = [item(k, label) for k, _, label in HISTOGRAMS if k.startswith(f"{kind}_")]
        return f"{kind} " + ", ".join(items)

    cpu = ", ".join(f"{child} {p:.0f}" for child, p in result["cpu_percent"].items()) or "-"
    return [
        prefix + f"{group('prefill')}; {group('frontend')}",
        prefix + f"{group('decode')}; CPU % {cpu}",
    ]
