"""RequestStatuses: what GET /status reports, with exact counts and eviction order."""

from __future__ import annotations

import pytest

from services.frontend.request_status import RequestStatuses, StatusReport


def test_a_request_is_processing_then_completed() -> None:
    statuses = RequestStatuses()
    entry = statuses.start("a", max_tokens=10)
    assert statuses.lookup("a") == StatusReport("a", "processing", 0, 10, None)
    entry.num_generated += 1
    entry.num_generated += 3
    assert statuses.lookup("a") == StatusReport("a", "processing", 4, 6, None)
    statuses.end(entry, "stop")
    assert statuses.lookup("a") == StatusReport("a", "completed", 4, 0, "stop")
    assert (statuses.num_in_flight, statuses.num_completed) == (0, 1)


def test_an_unknown_id_is_not_found() -> None:
    statuses = RequestStatuses()
    statuses.start("a", max_tokens=1)
    assert statuses.lookup("b") == StatusReport("b", "not_found", 0, 0, None)


def test_the_oldest_completed_falls_out_first() -> None:
    statuses = RequestStatuses(max_completed=3)
    for name in "abcde":
        statuses.end(statuses.start(name, max_tokens=1), "length")
    assert [statuses.lookup(n).status for n in "abcde"] == [
        "not_found",
        "not_found",
        "completed",
        "completed",
        "completed",
    ]
    assert statuses.num_completed == 3
    # "c" ends again: it moves to the back, so "d" is the next to go.
    statuses.end(statuses.start("c", max_tokens=1), "stop")
    statuses.end(statuses.start("f", max_tokens=1), "stop")
    assert [n for n in "cdef" if statuses.lookup(n).status == "completed"] == ["c", "e", "f"]
    assert statuses.lookup("c").finish_reason == "stop"


def test_requests_in_flight_are_never_evicted() -> None:
    statuses = RequestStatuses(max_completed=1)
    running = [statuses.start(f"r{i}", max_tokens=5) for i in range(4)]
    statuses.end(statuses.start("x", max_tokens=1), "stop")
    statuses.end(statuses.start("y", max_tokens=1), "stop")
    assert [statuses.lookup(e.request_id).status for e in running] == ["processing"] * 4
    assert statuses.lookup("x").status == "not_found"
    assert (statuses.num_in_flight, statuses.num_completed) == (4, 1)


def test_no_history_keeps_only_requests_in_flight() -> None:
    statuses = RequestStatuses(max_completed=0)
    entry = statuses.start("a", max_tokens=2)
    assert statuses.lookup("a").status == "processing"
    statuses.end(entry, "length")
    assert statuses.lookup("a").status == "not_found"
    assert statuses.num_completed == 0


def test_a_shared_id_reports_the_newest_request() -> None:
    statuses = RequestStatuses()
    old = statuses.start("same", max_tokens=10)
    old.num_generated = 7
    new = statuses.start("same", max_tokens=4)
    new.num_generated = 1
    assert statuses.lookup("same") == StatusReport("same", "processing", 1, 3, None)
    # The newest ends first: it is what the id reports, though the older still runs.
    statuses.end(new, "stop")
    assert statuses.lookup("same") == StatusReport("same", "completed", 1, 0, "stop")
    # The older ends later: the newer stays the id's report.
    statuses.end(old, "length")
    assert statuses.lookup("same") == StatusReport("same", "completed", 1, 0, "stop")
    assert (statuses.num_in_flight, statuses.num_completed) == (0, 1)


def test_a_newer_request_in_flight_hides_an_older_completed_one() -> None:
    statuses = RequestStatuses()
    statuses.end(statuses.start("id", max_tokens=3), "length")
    again = statuses.start("id", max_tokens=8)
    assert statuses.lookup("id") == StatusReport("id", "processing", 0, 8, None)
    again.num_generated = 2
    statuses.end(again, "cancelled")
    assert statuses.lookup("id") == StatusReport("id", "completed", 2, 0, "cancelled")
    assert statuses.num_completed == 1


def test_remaining_never_goes_below_zero() -> None:
    statuses = RequestStatuses()
    entry = statuses.start("a", max_tokens=4)
    entry.max_tokens = 2  # the prompt left less room than asked
    entry.num_generated = 3
    assert statuses.lookup("a").num_remaining == 0


def test_ending_twice_is_a_bug_caught() -> None:
    statuses = RequestStatuses()
    entry = statuses.start("a", max_tokens=1)
    statuses.end(entry, "stop")
    with pytest.raises(ValueError, match="not in flight"):
        statuses.end(entry, "stop")
    with pytest.raises(ValueError, match="max_completed"):
        RequestStatuses(max_completed=-1)


def test_a_request_with_several_choices_reports_them_together() -> None:
    """The HTTP API tracks choice i of request "r" as "r.i": "r" itself was not_found."""
    statuses = RequestStatuses()
    choices = [statuses.start(f"r.{i}", max_tokens=10) for i in range(3)]
    choices[0].num_generated, choices[1].num_generated = 4, 10
    statuses.end(choices[1], "length")
    assert statuses.lookup("r") == StatusReport("r", "processing", 14, 6 + 0 + 10, None)
    statuses.end(choices[0], "stop")
    statuses.end(choices[2], "stop")
    assert statuses.lookup("r") == StatusReport("r", "completed", 14, 0, "stop,length,stop")
    assert statuses.lookup("r.1") == StatusReport("r.1", "completed", 10, 0, "length")
    one = [statuses.start(f"s.{i}", max_tokens=1) for i in range(2)]
    for entry in one:
        statuses.end(entry, "length")
    assert statuses.lookup("s") == StatusReport("s", "completed", 0, 0, "length")
    assert statuses.lookup("r.3").status == statuses.lookup("q").status == "not_found"
