"""Restart delays of `mili serve`: exponential, capped, reset after a long enough run."""

from __future__ import annotations

from mili.serve.backoff import Backoff


def test_delays_double_per_failure_up_to_the_cap() -> None:
    backoff = Backoff()
    delays = [backoff.next_delay(up_s=1.0) for _ in range(9)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert backoff.num_failures == 9


def test_a_long_enough_run_starts_over() -> None:
    backoff = Backoff()
    assert [backoff.next_delay(up_s=0.0) for _ in range(3)] == [0.5, 1.0, 2.0]
    assert backoff.next_delay(up_s=59.9) == 4.0  # not quite long enough
    assert backoff.next_delay(up_s=60.0) == 0.5
    assert backoff.num_failures == 1
    assert backoff.next_delay(up_s=0.1) == 1.0


def test_a_crash_loop_never_overflows() -> None:
    backoff = Backoff()
    for _ in range(10_000):
        delay = backoff.next_delay(up_s=0.0)
    assert delay == 30.0
