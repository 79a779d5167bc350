"""benchmarks.service_metrics: a run's breakdown from two scrapes of the services' /metrics, and
`-` (never an error) for what a child did not say."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, start_http_server

from benchmarks import service_metrics


def test_scrape_reads_a_real_metrics_page_and_survives_a_dead_one() -> None:
    registry = CollectorRegistry()
    steps = Histogram("mili_decode_step_seconds", "", registry=registry)
    server, thread = start_http_server(0, "127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        before = service_metrics.snapshot({"decode-0": url})
        steps.observe(0.002)
        steps.observe(0.004)
        after = service_metrics.snapshot({"decode-0": url})
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    result = service_metrics.breakdown(before, after, wall_s=1.0)
    assert result["decode_step_ms"] == {"mean": 3.0, "count": 2}
    assert result["prefill_step_ms"] == {"mean": None, "count": None}
    assert service_metrics.scrape(url, timeout_s=1.0) == {}  # the server is gone


def test_means_sum_over_instances_and_missing_metrics_print_as_dashes() -> None:
    def child(step_sum: float, steps: float, cpu: float) -> dict[str, float]:
        return {
            "mili_prefill_step_seconds_sum": step_sum,
            "mili_prefill_step_seconds_count": steps,
            "process_cpu_seconds_total": cpu,
        }

    before = {"prefill-0": child(1.0, 10, 5.0), "prefill-1": child(0.0, 0, 1.0)}
    after = {"prefill-0": child(1.3, 13, 6.0), "prefill-1": child(0.1, 1, 1.5), "frontend": {}}
    result = service_metrics.breakdown(before, after, wall_s=2.0)
    assert result["prefill_step_ms"] == {"mean": 100.0, "count": 4}  # (0.3 + 0.1) s / 4
    assert result["cpu_percent"] == {"prefill-0": 50.0, "prefill-1": 25.0}
    first, second = service_metrics.lines(result)
    assert first.startswith("  breakdown: prefill batch - (n -), tokens - (n -), step 100.00 ms")
    assert "frontend queue - (n -), TTFT - (n -)" in first
    assert second == (
        "  breakdown: decode batch - (n -), step - (n -), KV - (n -); "
        "CPU % prefill-0 50, prefill-1 25"
    )
