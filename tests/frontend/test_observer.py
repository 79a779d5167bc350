"""RequestObserver: one request's metrics and its one log line, told what happens, without
servers (the span is covered end to end by tests/telemetry)."""

from __future__ import annotations

import logging
import re

import pytest
from prometheus_client import CollectorRegistry

from mili.engine.stop import FinishReason
from mili.errors import ResourceExhausted
from mili.telemetry.metrics import FrontendMetrics
from services.frontend.calls import PrefillStats, RequestIds
from services.frontend.observer import RequestObserver
from services.frontend.pipeline import Delta, Served
from services.frontend.router import Route

IDS = RequestIds("frontend-1", "client-1")
ROUTE = Route("p:1", "d:1")
MS = r"\d+\.\d ms"


def _observer() -> tuple[RequestObserver, FrontendMetrics]:
    metrics = FrontendMetrics(CollectorRegistry())
    return RequestObserver(metrics, IDS), metrics


def _count(metrics: FrontendMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(f"mili_frontend_{name}_seconds_count")


def _sample(metrics: FrontendMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def _outcomes(metrics: FrontendMetrics) -> dict[str, float]:
    """mili_frontend_requests_finished_total by outcome."""
    (family,) = (
        f for f in metrics.registry.collect() if f.name == "mili_frontend_requests_finished"
    )
    return {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")}


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mili.frontend"]


def test_latencies_are_observed_once_per_request_and_the_done_line_says_it_all(
    caplog: pytest.LogCaptureFixture,
) -> None:
    observer, metrics = _observer()
    observer.delta(Delta([], "", []))  # no token yet: nothing observed
    assert _count(metrics, "time_to_first_token") == 0
    observer.delta(Delta([5], "a"))
    observer.delta(Delta([6], "b"))
    last = Delta([7], "c", [], FinishReason.STOP, num_prompt_tokens=4, num_completion_tokens=3)
    observer.delta(last)
    assert _count(metrics, "time_to_first_token") == 1
    assert _count(metrics, "time_per_output_token") == 1
    assert _outcomes(metrics) == {}  # until it is done
    stats = PrefillStats(queue_ms=1.0, compute_ms=2.0, transfer_ms=4.0, kv_bytes=8_000_000)
    with caplog.at_level(logging.INFO, logger="mili.frontend"):
        observer.done(Served(ROUTE, last, stats, num_cached_blocks=2))
    assert _outcomes(metrics) == {"stop": 1}
    assert _count(metrics, "request_duration") == 1
    assert _sample(metrics, "mili_frontend_request_output_tokens_sum") == 3
    (line,) = _lines(caplog)
    assert re.fullmatch(
        rf"'client-1' \(id frontend-1\) done: prefill p:1 -> decode d:1, 4 prompt tokens, "
        rf"3 output tokens, finish {re.escape(str(FinishReason.STOP))}, ttft {MS}, total {MS}; "
        r"prefill queue 1\.0 ms, compute 2\.0 ms, KV 8000000 B in 4\.0 ms \(2\.000 GB/s\); "
        r"prefix cached: 0 tokens on prefill, 2 blocks on decode",
        line,
    ), line


def test_a_request_without_output_tokens_logs_no_ttft_and_observes_no_token_latency(
    caplog: pytest.LogCaptureFixture,
) -> None:
    observer, metrics = _observer()
    last = Delta([], "", [], FinishReason.LENGTH, num_prompt_tokens=2, num_completion_tokens=0)
    observer.delta(last)
    with caplog.at_level(logging.INFO, logger="mili.frontend"):
        observer.done(Served(ROUTE, last, None, num_cached_blocks=0))
        observer.done(Served(ROUTE, last, None, num_cached_blocks=0, queued_s=0.25))
    line, queued = _lines(caplog)
    assert re.fullmatch(
        r"'client-1' \(id frontend-1\) done: prefill p:1 -> decode d:1, 2 prompt tokens, 0 output "
        rf"tokens, finish {re.escape(str(FinishReason.LENGTH))}, ttft -, total {MS}",
        line,
    ), line
    # A request that waited in the admission queue says how long.
    assert ", ttft -, queued 250.0 ms, total " in queued, queued
    assert _count(metrics, "time_to_first_token") == _count(metrics, "time_per_output_token") == 0
    # Each ended whole, with no output: counted as answers of 0 tokens.
    assert _outcomes(metrics) == {"length": 2}
    assert _count(metrics, "request_duration") == 2
    assert _sample(metrics, "mili_frontend_request_output_tokens_bucket", le="1.0") == 2


def test_a_retried_request_says_how_often_and_why(caplog: pytest.LogCaptureFixture) -> None:
    """Each distinct reason once, with its count when it repeats, oldest first."""
    observer, _ = _observer()
    last = Delta([], "", [], FinishReason.LENGTH, num_prompt_tokens=2, num_completion_tokens=0)
    whys = ("decode at d:2 is down", "prefill at p:2 is full", "prefill at p:2 is full")
    with caplog.at_level(logging.INFO, logger="mili.frontend"):
        observer.done(Served(ROUTE, last, None, num_cached_blocks=0), whys[:1])
        observer.done(Served(ROUTE, last, None, num_cached_blocks=0), whys)
    once, thrice = _lines(caplog)
    assert " done: prefill p:1 -> decode d:1 (retried 1 time: decode at d:2 is down), 2 " in once
    assert (
        " done: prefill p:1 -> decode d:1 (retried 3 times: decode at d:2 is down; "
        "2x prefill at p:2 is full), 2 prompt tokens"
    ) in thrice


def test_a_failed_or_cancelled_request_says_its_retries(caplog: pytest.LogCaptureFixture) -> None:
    whys = ("decode at d:2 is down",)
    with caplog.at_level(logging.INFO, logger="mili.frontend"):
        _observer()[0].failed(ResourceExhausted("full"), whys)
        _observer()[0].cancelled(None, retried=whys)
    failed, cancelled = _lines(caplog)
    said = r" \(retried 1 time: decode at d:2 is down\): "
    assert re.search(rf" failed after {MS}{said}RESOURCE_EXHAUSTED: full$", failed), failed
    assert re.search(rf" CANCELLED after {MS}{said}the caller cancelled$", cancelled), cancelled


def test_every_end_counts_once_by_outcome() -> None:
    """Failed: its status; cut short: CANCELLED (the caller), DEADLINE_EXCEEDED (grpc's clock
    ran out) or UNAVAILABLE (this server's drain). Only whole answers have a duration."""
    metrics = FrontendMetrics(CollectorRegistry())
    RequestObserver(metrics, IDS).failed(ResourceExhausted("full"))
    RequestObserver(metrics, IDS).cancelled(5.0)
    RequestObserver(metrics, IDS).cancelled(0.0)
    RequestObserver(metrics, IDS).cancelled(None, cut="the server drained")
    RequestObserver(metrics, IDS).cancelled(None)
    assert _outcomes(metrics) == {
        "RESOURCE_EXHAUSTED": 1,
        "CANCELLED": 2,
        "DEADLINE_EXCEEDED": 1,
        "UNAVAILABLE": 1,
    }
    assert _count(metrics, "request_duration") == 0


def test_a_failure_logs_its_status_and_error(caplog: pytest.LogCaptureFixture) -> None:
    observer, _ = _observer()
    with caplog.at_level(logging.INFO, logger="mili.frontend"):
        observer.failed(ResourceExhausted("every decode instance is full"))
    (line,) = _lines(caplog)
    assert re.fullmatch(
        rf"'client-1' \(id frontend-1\) failed after {MS}: RESOURCE_EXHAUSTED: every decode "
        "instance is full",
        line,
    ), line


def test_a_request_cut_short_says_how_many_output_tokens_it_got(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by an operator's pass: a request that failed or was cancelled mid-stream said
    nothing of how far it got (its span had no output token count either)."""
    with caplog.at_level(logging.INFO, logger="mili.frontend"):
        for end in ("failed", "cancelled"):
            observer, _ = _observer()
            observer.delta(Delta([5, 6], "ab"))
            observer.delta(Delta([7], "c"))
            if end == "failed":
                observer.failed(ResourceExhausted("full"))
            else:
                observer.cancelled(None)
    failed, cancelled = _lines(caplog)
    assert re.search(rf" failed after {MS}, 3 output tokens: RESOURCE_EXHAUSTED: full$", failed)
    assert re.search(rf" CANCELLED after {MS}, 3 output tokens: the caller cancelled$", cancelled)


@pytest.mark.parametrize(
    ("remaining_s", "said"),
    [
        (None, "CANCELLED after {MS}: the caller cancelled"),
        (3.0, "CANCELLED after {MS}: the caller cancelled"),
        (0.01, "DEADLINE_EXCEEDED after {MS}: the caller's deadline passed"),
    ],
)
def test_an_ended_call_says_whether_the_caller_cancelled_or_its_deadline_passed(
    remaining_s: float | None, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    observer, _ = _observer()
    with caplog.at_level(logging.INFO, logger="mili.frontend"):
        observer.cancelled(remaining_s)
    (line,) = _lines(caplog)
    assert re.fullmatch(r"'client-1' \(id frontend-1\) " + said.format(MS=MS), line), line


def test_a_call_its_own_drain_cut_says_so_not_that_the_caller_cancelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    observer, _ = _observer()
    with caplog.at_level(logging.INFO, logger="mili.frontend"):
        observer.cancelled(3.0, "frontend stopped before this call finished: (why)")
    (line,) = _lines(caplog)
    assert re.fullmatch(
        rf"'client-1' \(id frontend-1\) UNAVAILABLE after {MS}: frontend stopped before this "
        r"call finished: \(why\)",
        line,
    ), line


def test_a_client_id_cannot_pass_for_the_line_s_other_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    forged = "x (id frontend-9) done: prefill p:9 -> decode d:9\n'quoted' \"too\" finish=stop"
    observer = RequestObserver(
        FrontendMetrics(CollectorRegistry()), RequestIds("frontend-1", forged)
    )
    with caplog.at_level(logging.INFO, logger="mili.frontend"):
        observer.failed(ResourceExhausted("full"))
    (line,) = _lines(caplog)
    # The id is one Python literal (quotes and newline escaped) ahead of the frontend's own id.
    assert line.startswith(f"{forged!r} (id frontend-1) failed after "), line
    assert "\n" not in line and line.count(" (id ") == 2 and line.count(" done: ") == 1


def test_counts_of_one_are_singular_in_every_line(caplog: pytest.LogCaptureFixture) -> None:
    """Found by an operator's pass: a one-token request logged "1 prompt tokens, 1 output
    tokens" (and "1 tokens on prefill, 1 blocks on decode"); every count takes its noun from
    mili.plural."""
    observer, _ = _observer()
    last = Delta([7], "c", [], FinishReason.LENGTH, num_prompt_tokens=1, num_completion_tokens=1)
    observer.delta(last)
    stats = PrefillStats(1.0, 2.0, 4.0, 8_000_000, num_cached_tokens=1)
    with caplog.at_level(logging.INFO, logger="mili.frontend"):
        observer.done(Served(ROUTE, last, stats, num_cached_blocks=1))
        cut, _ = _observer()
        cut.delta(Delta([5], "a"))
        cut.failed(ResourceExhausted("full"))
    done, failed = _lines(caplog)
    assert " done: prefill p:1 -> decode d:1, 1 prompt token, 1 output token, finish " in done
    assert done.endswith("; prefix cached: 1 token on prefill, 1 block on decode"), done
    assert re.search(rf" failed after {MS}, 1 output token: RESOURCE_EXHAUSTED: full$", failed)
