"""Waiting for room: the asyncio side of the admission queue (admission.py).

    Placement ─── admit(arrival, attempt, deadline) ──▶ queue empty: attempt() at once
                                                          │ NoRoom (every instance full)
                                                          ▼
                            push ─▶ wait for its turn ─▶ attempt() ─▶ admitted: return
                               ▲          │                 │ NoRoom
                               │   deadline passed:         └──▶ wait for the next turn
                               │   DEADLINE_EXCEEDED
                               │   caller cancelled: out of the queue, nothing reserved
    notify(): room may have freed (a request of ours left an instance, Info was polled, a
    prefill call ended) ──▶ the head's turn

`attempt` does the routing and asks the instances (placement.py); it raises NoRoom when every
instance that could take the request is full, which means "wait", and anything else to fail
the request. Nothing is reserved while a request waits: a request cancelled or past its
deadline in the queue simply leaves it.

Queue depth and waits are what an operator watches (FrontendMetrics: gauges read at scrape
time, `on_wait` observes each wait), and each request's trace shows its stay: span events
"queued" (position, depth) and "dequeued" (wait, outcome), and the total wait as the span
attribute mili.queue.wait_s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from opentelemetry import trace

from mili.errors import DeadlineExceeded, ResourceExhausted
from mili.plural import plural
from services.frontend.admission import AdmissionQueue, Waiter
from services.frontend.calls import Deadline

_T = TypeVar("_T")


class NoRoom(Exception):
    """Every instance that could take the request is full now: wait in the queue."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def is_refused_for_room(error: BaseException | None) -> bool:
    """A capacity refusal (RESOURCE_EXHAUSTED with a retry hint): waiting helps. Without the
    hint it is a limit no wait lifts (a message over a size limit)."""
    return isinstance(error, ResourceExhausted) and error.retry_after_s is not None


@dataclass
class Arrival:
    """One request's place in line, from its arrival to its admission (it may queue twice:
    prefill can turn it away after decode admitted it)."""

    seq: int  # arrival order
    num_tokens: int  # prompt tokens
    # False: it waits past the queue's bounds (a later choice of an HTTP request with several,
    # taken when its first was: turned away, it would fail the choices already running)
    is_bounded: bool = True
    priority: int = 0  # lower waits ahead of higher (admission.py)
    waited_s: float = 0.0  # in the queue, all its stays together


class Admitter:
    """The admission queue of one frontend, and the turns of the requests waiting in it."""

    def __init__(
        self,
        queue: AdmissionQueue,
        *,
        on_wait: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_wait(seconds)`: called each time a request leaves the queue (a metric)."""
        self.queue = queue
        self.on_wait = on_wait
        self._clock = clock
        self._turns: dict[Waiter, asyncio.Event] = {}

    @property
    def num_waiting(self) -> int:
        return len(self.queue)

    @property
    def num_waiting_tokens(self) -> int:
        return self.queue.num_tokens

    def arrive(self, num_tokens: int, *, is_bounded: bool = True, priority: int = 0) -> Arrival:
        """Take a place in line as the request arrives (before it first tries)."""
        return Arrival(self.queue.arrive(), num_tokens, is_bounded=is_bounded, priority=priority)

    def notify(self) -> None:
        """Room may have freed on some instance: the head's turn."""
        self.queue.room()
        self._wake()

    async def admit(
        self,
        arrival: Arrival,
        attempt: Callable[[], Awaitable[_T]],
        deadline: Deadline,
        *,
        no_room: NoRoom | None = None,
    ) -> _T:
        """`attempt()`'s result, once it has one: at once when no one waits, else when the
        request's turn comes and there is room. `no_room`: the request already found none
        (prefill turned it away after decode admitted it): it goes straight back in line.

        Raises what `attempt` raises other than NoRoom; ResourceExhausted (with RetryInfo)
        when the request would wait and the queue is full; DeadlineExceeded when the deadline
        passes while it waits.
        """
        is_past_bounds = no_room is not None or not arrival.is_bounded
        # No one waits, or only requests it goes ahead of (a lower priority): it tries at once
        if no_room is None and self.queue.is_first(arrival.priority):
            try:
                return await attempt()
            except NoRoom as refused:
                no_room = refused
        if no_room is not None:
            why, retry_after_s = str(no_room), no_room.retry_after_s
        else:
            ahead = plural(self.queue.num_ahead(arrival.priority), "request")
            why, retry_after_s = f"{ahead} ahead of it in the queue", None
        waiter = Waiter(arrival.seq, arrival.num_tokens, arrival.priority)
        self.queue.push(waiter, why=why, retry_after_s=retry_after_s, is_return=is_past_bounds)
        turn = self._turns[waiter] = asyncio.Event()
        span = trace.get_current_span()
        span.add_event(
            "queued",
            {
                "mili.queue.position": self.queue.position(waiter),
                "mili.queue.depth": len(self.queue),
                "mili.queue.reason": why,
            },
        )
        queued_at = self._clock()
        outcome = "cancelled"
        try:
            self._wake()  # room may have freed while it tried
            while True:
                await self._wait(turn, deadline, waiter)
                turn.clear()
                try:
                    result = await attempt()
                except NoRoom:
                    self.queue.end_try(waiter, is_admitted=False)
                    self._wake()  # room that freed during the try: its turn again
                    continue
                self.queue.end_try(waiter, is_admitted=True)
                outcome = "admitted"
                return result
        except DeadlineExceeded:
            outcome = "deadline exceeded"
            raise
        except Exception as exc:
            outcome = type(exc).__name__
            raise
        finally:
            del self._turns[waiter]
            self.queue.remove(waiter)  # no-op when admitted
            waited_s = self._clock() - queued_at
            arrival.waited_s += waited_s
            if self.on_wait is not None:
                self.on_wait(waited_s)
            span.add_event(
                "dequeued", {"mili.queue.wait_s": waited_s, "mili.queue.outcome": outcome}
            )
            span.set_attribute("mili.queue.wait_s", arrival.waited_s)
            self._wake()  # the next one's turn, if this one's leaving gave it one

    async def _wait(self, turn: asyncio.Event, deadline: Deadline, waiter: Waiter) -> None:
        """Until the waiter's turn, unless its deadline passes first (also during its last
        try: a turn set then is not another try, which decode would admit and prefill start
        only for the request to fail a moment later)."""
        try:
            if deadline.has_passed:
                raise TimeoutError
            if turn.is_set():
                return
            async with asyncio.timeout(deadline.remaining()):
                await turn.wait()
        except TimeoutError:
            raise DeadlineExceeded(
                "the deadline passed while the request waited for room in the admission queue "
                f"(place {self.queue.position(waiter) + 1} of {len(self.queue)})"
            ) from None

    def _wake(self) -> None:
        waiter = self.queue.take_turn()
        if waiter is not None:
            self._turns[waiter].set()
