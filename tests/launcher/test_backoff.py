"""Restart delays of `mili serve`: exponential, capped, reset after a long enough run."""

from __future__ import annotations

import pytest

from mili.serve.backoff import Backoff, RestartPolicy


def test_delays_double_per_failure_up_to_the_cap() -> None:
    backoff = Backoff(RestartPolicy(initial_delay_s=0.5, max_delay_s=30.0, reset_after_s=60.0))
    delays = [backoff.next_delay(up_s=1.0) for _ in range(9)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert backoff.num_failures == 9


def test_a_long_enough_run_starts_over() -> None:
    backoff = Backoff(RestartPolicy(initial_delay_s=1.0, max_delay_s=8.0, reset_after_s=60.0))
    assert [backoff.next_delay(up_s=0.0) for _ in range(3)] == [1.0, 2.0, 4.0]
    assert backoff.next_delay(up_s=59.9) == 8.0  # not quite long enough
    assert backoff.next_delay(up_s=60.0) == 1.0
    assert backoff.num_failures == 1
    assert backoff.next_delay(up_s=0.1) == 2.0


def test_a_crash_loop_never_overflows() -> None:
    backoff = Backoff(RestartPolicy(initial_delay_s=0.5, max_delay_s=30.0, factor=10.0))
    for _ in range(10_000):
        delay = backoff.next_delay(up_s=0.0)
    assert delay == 30.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_delay_s": 0.0},
        {"initial_delay_s": 5.0, "max_delay_s": 1.0},
        {"factor": 0.5},
        {"reset_after_s": 0.0},
    ],
)
def test_policy_is_checked(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)
