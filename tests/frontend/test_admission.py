"""The admission queue's bookkeeping (services/frontend/admission.py), exact order and counts:
arrival order, bounds, turns (one try at a time, news of room kept), leaving (cancel, deadline)."""

from __future__ import annotations

import pytest

from mili.errors import ResourceExhausted
from services.frontend.admission import AdmissionQueue, Waiter


def queue_of(
    *num_tokens: int, max_requests: int = 8, max_tokens: int = 1000
) -> tuple[AdmissionQueue, list[Waiter]]:
    queue = AdmissionQueue(max_requests, max_tokens, retry_after_s=0.5)
    waiters = [Waiter(queue.arrive(), n) for n in num_tokens]
    for waiter in waiters:
        queue.push(waiter)
    return queue, waiters


def seqs(queue: AdmissionQueue) -> list[int]:
    return [w.seq for w in queue.waiters]


def test_arrivals_are_numbered_in_order_and_equal_requests_go_first_come_first_served() -> None:
    queue, (a, b, c) = queue_of(4, 4, 4)
    assert [a.seq, b.seq, c.seq] == [1, 2, 3]
    assert (len(queue), queue.num_tokens, queue.head) == (3, 12, a)
    order = []
    queue.room()
    while (turn := queue.take_turn()) is not None:
        order.append(turn.seq)
        queue.end_try(turn, is_admitted=True)  # admitted: the next one tries at once
    assert order == [1, 2, 3]
    assert (len(queue), queue.num_tokens) == (0, 0)


def test_a_waiter_takes_its_place_by_arrival_not_by_when_it_was_pushed() -> None:
    queue = AdmissionQueue(8, 1000)
    first, second, third = (queue.arrive() for _ in range(3))
    queue.push(Waiter(second, 1))
    queue.push(Waiter(third, 1))
    queue.push(Waiter(first, 1))  # it tried at once (or prefill turned it away): back in front
    assert seqs(queue) == [1, 2, 3]
    with pytest.raises(ValueError, match="queued already"):
        queue.push(Waiter(first, 1))


def test_a_lower_priority_number_waits_ahead_then_arrival_order() -> None:
    queue = AdmissionQueue(8, 1000)
    low, mid, high, mid_later = (queue.arrive() for _ in range(4))
    assert queue.is_first(0) and queue.num_ahead(0) == 0
    queue.push(Waiter(low, 1, priority=5))
    queue.push(Waiter(mid, 1))
    assert queue.num_ahead(0) == 1 and queue.num_ahead(-1) == 0 and queue.num_ahead(9) == 2
    assert queue.is_first(-1) and not queue.is_first(0)
    queue.push(Waiter(mid_later, 1))
    queue.push(Waiter(high, 1, priority=-3))  # arrived before mid_later, and goes first
    assert seqs(queue) == [high, mid, mid_later, low]
    order = []
    queue.room()
    while (turn := queue.take_turn()) is not None:
        order.append(turn.seq)
        queue.end_try(turn, is_admitted=True)
    assert order == [high, mid, mid_later, low]


def test_only_the_head_tries_one_try_at_a_time_and_only_after_news_of_room() -> None:
    queue, (a, b) = queue_of(4, 1)
    assert queue.take_turn() is None  # no room freed since they were pushed
    queue.room()
    assert queue.take_turn() is a
    queue.room()  # room frees while the head tries
    assert queue.take_turn() is None  # one try at a time
    queue.end_try(a, is_admitted=False)
    # The room that freed during the try gives the head another try at once.
    assert queue.take_turn() is a
    queue.end_try(a, is_admitted=False)
    # Head of line: a does not fit, b (smaller) waits behind it: no news, no turn.
    assert queue.take_turn() is None and seqs(queue) == [a.seq, b.seq]
    queue.room()
    assert queue.take_turn() is a
    queue.end_try(a, is_admitted=True)
    assert queue.take_turn() is b  # an admission may leave room for the next


def test_a_head_that_leaves_unadmitted_gives_the_next_a_turn() -> None:
    queue, (a, b, c) = queue_of(100, 1, 1)
    queue.room()
    assert queue.take_turn() is a
    queue.end_try(a, is_admitted=False)
    assert queue.take_turn() is None
    assert queue.remove(a)  # its deadline passed, or its caller cancelled
    assert queue.take_turn() is b  # b may fit where a did not
    queue.end_try(b, is_admitted=False)
    assert queue.remove(c)  # not the head: no news for b
    assert queue.take_turn() is None
    assert not queue.remove(c)
    assert (seqs(queue), queue.num_tokens) == ([b.seq], 1)


def test_a_waiter_leaving_while_it_tries_frees_the_turn() -> None:
    queue, (a, b) = queue_of(1, 1)
    queue.room()
    assert queue.take_turn() is a
    assert queue.remove(a)  # cancelled in the middle of its try
    assert queue.take_turn() is b
    with pytest.raises(ValueError, match="not trying"):
        queue.end_try(a, is_admitted=True)


def test_news_of_room_is_kept_until_a_waiter_comes() -> None:
    queue = AdmissionQueue(8, 1000)
    queue.room()  # room freed while a request tried at once and found none
    waiter = Waiter(queue.arrive(), 1)
    queue.push(waiter)
    assert queue.take_turn() is waiter  # so it tries again at once


def test_an_admission_behind_an_older_waiter_pushed_back_still_gives_news() -> None:
    queue = AdmissionQueue(8, 1000)
    old, young = Waiter(queue.arrive(), 1), Waiter(queue.arrive(), 1)
    queue.push(young)
    queue.room()
    assert queue.take_turn() is young
    queue.push(old)  # prefill turned it away: back in its place, ahead of the one trying
    assert seqs(queue) == [old.seq, young.seq]
    queue.end_try(young, is_admitted=True)
    assert queue.take_turn() is old


def test_the_count_bound_refuses_with_a_retry_hint_and_queues_nothing() -> None:
    queue, _ = queue_of(1, 1, max_requests=2)
    with pytest.raises(ResourceExhausted) as info:
        queue.push(Waiter(queue.arrive(), 1), why="every decode instance is full (d:1: full)")
    assert info.value.retry_after_s == 0.5
    assert str(info.value) == (
        "every decode instance is full (d:1: full), and the admission queue is full (2 of 2 "
        "requests waiting); retry later"
    )
    with pytest.raises(ResourceExhausted) as info:
        queue.push(Waiter(queue.arrive(), 1), retry_after_s=0.25)  # decode's own hint
    assert info.value.retry_after_s == 0.25
    assert (len(queue), queue.num_tokens) == (2, 2)


def test_the_token_bound_counts_prompt_tokens_but_lets_one_waiter_into_an_empty_queue() -> None:
    queue = AdmissionQueue(8, max_tokens=10)
    big = Waiter(queue.arrive(), 50)
    queue.push(big)  # alone: a bound below the longest prompt must not refuse it for good
    with pytest.raises(
        ResourceExhausted, match="50 prompt tokens waiting, 1 more would pass its limit of 10"
    ):
        queue.push(Waiter(queue.arrive(), 1))
    queue.remove(big)
    small = [Waiter(queue.arrive(), 5), Waiter(queue.arrive(), 5)]
    for waiter in small:
        queue.push(waiter)
    with pytest.raises(ResourceExhausted, match="10 prompt tokens waiting"):
        queue.push(Waiter(queue.arrive(), 1))
    assert queue.num_tokens == 10


def test_a_bound_of_zero_requests_means_no_waiting() -> None:
    queue = AdmissionQueue(0, 1000)
    with pytest.raises(ResourceExhausted, match=r"0 of 0 requests waiting"):
        queue.push(Waiter(queue.arrive(), 1))
    with pytest.raises(ValueError, match=">= 0"):
        AdmissionQueue(-1, 10)


def test_position_counts_from_the_head() -> None:
    queue, (a, b, c) = queue_of(1, 1, 1)
    assert [queue.position(w) for w in (a, b, c)] == [0, 1, 2]
    assert b in queue and Waiter(99, 1) not in queue
