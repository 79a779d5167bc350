"""Waiting in the admission queue (services/frontend/admitter.py), in one event loop without
sockets: `attempt` is a fake that admits while a room counter lasts."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from mili.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from services.frontend.admission import AdmissionQueue
from services.frontend.admitter import Admitter, NoRoom
from services.frontend.calls import Deadline


class Instances:
    """`room` places; an attempt takes one or raises NoRoom. Records who tried, in order."""

    def __init__(self, room: int = 0) -> None:
        self.room = room
        self.tries: list[str] = []
        self.admitted: list[str] = []

    def attempt(self, name: str) -> Callable[[], Awaitable[str]]:
        async def attempt() -> str:
            self.tries.append(name)
            await asyncio.sleep(0)  # a round trip
            if self.room <= 0:
                raise NoRoom("every decode instance is full (d:1: full)", retry_after_s=0.25)
            self.room -= 1
            self.admitted.append(name)
            return name

        return attempt


def admitter(max_requests: int = 8, waits: list[float] | None = None) -> Admitter:
    return Admitter(
        AdmissionQueue(max_requests, 1000, retry_after_s=0.5),
        on_wait=None if waits is None else waits.append,
    )


async def start(
    adm: Admitter,
    instances: Instances,
    name: str,
    deadline_s: float | None = 5.0,
    priority: int = 0,
) -> asyncio.Task[str]:
    """Start `name`'s admission and let it run until it tried once or waits."""
    arrival = adm.arrive(num_tokens=4, priority=priority)
    task = asyncio.create_task(adm.admit(arrival, instances.attempt(name), Deadline(deadline_s)))
    for _ in range(5):
        await asyncio.sleep(0)
    return task


def test_with_room_and_no_one_waiting_it_is_admitted_at_once_without_queueing() -> None:
    async def main() -> None:
        waits: list[float] = []
        adm, instances = admitter(waits=waits), Instances(room=1)
        assert await (await start(adm, instances, "a")) == "a"
        assert instances.tries == ["a"] and waits == []  # never queued: no wait observed

    asyncio.run(main())


def test_waiters_are_admitted_first_come_first_served_as_room_frees() -> None:
    async def main() -> None:
        waits: list[float] = []
        adm, instances = admitter(waits=waits), Instances(room=0)
        a = await start(adm, instances, "a")  # tries at once, finds no room, queues
        b = await start(adm, instances, "b")  # someone waits: queues without trying
        c = await start(adm, instances, "c")
        assert instances.tries == ["a"] and adm.num_waiting == 3
        assert adm.num_waiting_tokens == 12
        instances.room = 2
        adm.notify()
        assert await a == "a" and await b == "b"
        await asyncio.sleep(0.01)
        # The head tries once per turn: a, then b (an admission may leave room), then c.
        assert instances.tries == ["a", "a", "b", "c"]
        assert not c.done() and adm.num_waiting == 1
        instances.room = 1
        adm.notify()
        assert await c == "c"
        assert instances.admitted == ["a", "b", "c"]
        assert len(waits) == 3 and adm.num_waiting == 0

    asyncio.run(main())


def test_a_lower_priority_number_is_admitted_before_those_waiting_longer() -> None:
    async def main() -> None:
        adm, instances = admitter(), Instances(room=0)
        a = await start(adm, instances, "a", priority=1)  # tries at once, finds no room
        b = await start(adm, instances, "b", priority=1)  # waits behind a without trying
        urgent = await start(adm, instances, "urgent", priority=-1)  # would be the head: tries
        assert instances.tries == ["a", "urgent"] and adm.num_waiting == 3
        instances.room = 1
        adm.notify()
        assert await urgent == "urgent"
        await asyncio.sleep(0.01)
        assert not a.done() and not b.done()
        instances.room = 2
        adm.notify()
        assert (await a, await b) == ("a", "b")
        assert instances.admitted == ["urgent", "a", "b"]

    asyncio.run(main())


def test_a_full_queue_is_resource_exhausted_with_the_instances_retry_hint() -> None:
    async def main() -> None:
        adm, instances = admitter(max_requests=1), Instances(room=0)
        a = await start(adm, instances, "a")
        b = await start(adm, instances, "b")  # a waits: b would queue, past the bound
        with pytest.raises(ResourceExhausted) as info:
            await b
        assert str(info.value) == (
            "1 request ahead of it in the queue, and the admission queue is full (1 of 1 "
            "request waiting); retry later"
        )
        assert info.value.retry_after_s == 0.5  # the queue's hint: b asked no instance
        a.cancel()
        alone = admitter(max_requests=0)
        with pytest.raises(ResourceExhausted) as info:
            await (await start(alone, instances, "c"))  # no waiting: refused after one try
        assert str(info.value).startswith("every decode instance is full (d:1: full), and")
        assert info.value.retry_after_s == 0.25  # the instances' own hint

    asyncio.run(main())


def test_a_deadline_passing_in_the_queue_is_deadline_exceeded_and_frees_the_turn() -> None:
    async def main() -> None:
        waits: list[float] = []
        adm, instances = admitter(waits=waits), Instances(room=0)
        a = await start(adm, instances, "a", deadline_s=0.05)
        b = await start(adm, instances, "b")
        with pytest.raises(DeadlineExceeded, match=r"admission queue \(place 1 of 2\)"):
            await a
        assert adm.num_waiting == 1 and waits and waits[0] >= 0.04
        await asyncio.sleep(0.01)
        assert instances.tries == ["a", "b"]  # the head left: b's turn (it may fit)
        instances.room = 1
        adm.notify()
        assert await b == "b"

    asyncio.run(main())


def test_a_deadline_passing_during_a_try_is_not_tried_again() -> None:
    """Found by a read-only review: the head's try outlived its deadline, room was announced
    meanwhile, so its turn came at once and a second try ran past the deadline (decode admits,
    prefill starts, and the request fails a moment later)."""

    async def main() -> None:
        adm = admitter()
        tries: list[bool] = []  # whether the deadline had passed, per try
        deadline = Deadline(0.05)

        async def attempt() -> str:
            tries.append(deadline.has_passed)
            await asyncio.sleep(0.1)  # a decode slow to answer, within admit_timeout_s
            if len(tries) == 1:
                raise NoRoom("every decode instance is full", retry_after_s=0.25)
            return "admitted"

        a = asyncio.create_task(adm.admit(adm.arrive(num_tokens=4), attempt, deadline))
        await asyncio.sleep(0.02)
        adm.notify()  # room may have freed: during a's first try
        with pytest.raises(DeadlineExceeded, match="admission queue"):
            await a
        assert tries == [False] and adm.num_waiting == 0

    asyncio.run(main())


def test_a_caller_cancelling_in_the_queue_leaves_it_and_nothing_was_taken() -> None:
    async def main() -> None:
        adm, instances = admitter(), Instances(room=0)
        a = await start(adm, instances, "a")
        b = await start(adm, instances, "b")
        c = await start(adm, instances, "c")
        b.cancel()  # not the head: a keeps waiting for room
        await asyncio.sleep(0.01)
        assert adm.num_waiting == 2 and instances.tries == ["a"]
        a.cancel()  # the head: c's turn
        await asyncio.sleep(0.01)
        assert adm.num_waiting == 1 and instances.tries == ["a", "c"]
        instances.room = 1
        adm.notify()
        assert await c == "c" and instances.admitted == ["c"]
        assert a.cancelled() and b.cancelled()

    asyncio.run(main())


def test_a_waiter_cancelled_in_its_try_gives_the_turn_to_the_next() -> None:
    async def main() -> None:
        adm, instances = admitter(), Instances(room=0)
        hang = asyncio.Event()

        async def hanging() -> str:
            instances.tries.append("a")
            await hang.wait()
            raise NoRoom("full")

        arrival = adm.arrive(num_tokens=4)
        a = asyncio.create_task(adm.admit(arrival, hanging, Deadline(5.0)))
        await asyncio.sleep(0)
        hang.set()  # the first try (at once) finds no room
        await asyncio.sleep(0.01)
        hang.clear()
        b = await start(adm, instances, "b")
        adm.notify()
        await asyncio.sleep(0.01)
        assert instances.tries == ["a", "a"]  # a tries again, and hangs
        a.cancel()
        await asyncio.sleep(0.01)
        assert instances.tries == ["a", "a", "b"]
        instances.room = 1
        adm.notify()
        assert await b == "b"

    asyncio.run(main())


def test_other_errors_fail_the_request_and_leave_the_queue() -> None:
    async def main() -> None:
        adm, instances = admitter(), Instances(room=0)
        a = await start(adm, instances, "a")

        async def down() -> str:
            raise Unavailable("no decode instance is reachable")

        b = asyncio.create_task(adm.admit(adm.arrive(1), down, Deadline(5.0)))
        await asyncio.sleep(0.01)
        assert adm.num_waiting == 2  # behind a, without trying
        a.cancel()  # b is the head now: its turn
        with pytest.raises(Unavailable):
            await b
        assert adm.num_waiting == 0

    asyncio.run(main())


def test_a_request_pushed_back_into_a_full_queue_is_not_refused() -> None:
    """Found by a read-only review: with the queue full of later arrivals, the request prefill
    turned away (decode had admitted it) was the one refused (RESOURCE_EXHAUSTED) while the
    younger ones kept their places. It goes back in line, ahead of them."""

    async def main() -> None:
        adm, instances = admitter(max_requests=1), Instances(room=0)
        first = adm.arrive(num_tokens=4)  # admitted earlier; then prefill turned it away
        b = await start(adm, instances, "b")  # queued: the queue is full
        again = asyncio.create_task(
            adm.admit(first, instances.attempt("first"), Deadline(5.0), no_room=NoRoom("full"))
        )
        await asyncio.sleep(0.01)
        assert not again.done() and adm.num_waiting == 2
        with pytest.raises(ResourceExhausted):  # a new arrival still meets the bound
            await adm.admit(adm.arrive(num_tokens=4), instances.attempt("c"), Deadline(5.0))
        instances.room = 2
        adm.notify()
        assert await again == "first" and await b == "b"
        assert instances.admitted == ["first", "b"]

    asyncio.run(main())


def test_a_request_pushed_back_keeps_its_place_by_arrival() -> None:
    async def main() -> None:
        adm, instances = admitter(), Instances(room=0)
        first = adm.arrive(num_tokens=4)  # admitted earlier; then prefill turned it away
        b = await start(adm, instances, "b")
        again = asyncio.create_task(
            adm.admit(first, instances.attempt("first"), Deadline(5.0), no_room=NoRoom("full"))
        )
        await asyncio.sleep(0.01)
        assert instances.tries == ["b"]  # pushed back without trying at once
        instances.room = 2
        adm.notify()
        assert await again == "first" and await b == "b"
        assert instances.admitted == ["first", "b"]
        assert first.waited_s > 0

    asyncio.run(main())
