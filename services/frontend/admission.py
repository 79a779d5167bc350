"""The admission queue: requests waiting for room on a decode (and prefill) instance. Pure Python.

The frontend sees every decode instance, so it holds the queue (docs/architecture.md, "queue,
constrain, route"). A request that finds no instance with room waits here, first come first
served, and tries again when room may have freed; only past the queue's bound is it refused.

    arrive ─▶ queue empty? ──yes──▶ try at once (no queue) ──room──▶ admitted
                   │no                     │every instance full
                   ▼                       ▼
              push (by arrival) ◀──────────┘        past max_requests / max_tokens: refused
                   │
        room() ──▶ take_turn: the head tries ──room──▶ end_try(admitted) ──▶ next head's turn
                                   │full
                                   └──▶ end_try(not admitted): waits for the next room()

Order. Waiters are kept by priority (lower first: vLLM's sense of its `priority`; 0 unless the
caller set one), then by arrival number (`arrive`), not by when they were pushed: one that
tried at once and found every instance full, or one whose prefill turned it away after decode
admitted it (it is pushed again), takes its place among the others by when it arrived. A
request that would be the head tries at once: one of a lower priority number than every
waiter does not wait behind them. Priority orders the wait only: a running request is never
stopped for one.

Head of line. Only the head tries, one try at a time: when the head does not fit, later
requests wait behind it even where a smaller one would fit (vLLM's first-come-first-served
waiting queue does the same). Large requests are never starved by a stream of small ones; the
cost is that a large head holds the others until room frees for it, bounded by its deadline
(the frontend refuses at once a request that no instance could ever hold). Several frontends
each have their own queue; across them, a decode instance holds room for the earliest request
it turned away (services/decode/requests.py).

Turns. `room()` says room may have freed (a request left an instance, an instance's Info was
polled); the news is kept until the head takes its turn, so room that freed while the head was
trying gives it another try at once. A head that leaves without being admitted (cancelled, its
deadline passed, failed) gives the next one a turn: that one may fit where the head did not.

Bookkeeping only: who is woken, and how, is the caller's (services/frontend/admitter.py).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from mili.errors import ResourceExhausted
from mili.plural import plural


@dataclass(eq=False)
class Waiter:
    """One request in the queue."""

    seq: int  # arrival number from `AdmissionQueue.arrive`: lower arrived first
    num_tokens: int  # prompt tokens, counted against the queue's token bound
    priority: int = 0  # lower waits ahead of higher; arrival order within one

    @property
    def place(self) -> tuple[int, int]:
        return self.priority, self.seq


class AdmissionQueue:
    """`Waiter`s by priority, then first come first served; bounded by count and prompt tokens
    (a waiter that comes back after it was admitted, `push(is_return=True)`, is let in past
    them)."""

    def __init__(
        self, max_requests: int, max_tokens: int, *, retry_after_s: float | None = None
    ) -> None:
        """`max_requests` 0: no waiting, a request that finds every instance full is refused.
        `retry_after_s`: the hint sent with a refusal."""
        if max_requests < 0 or max_tokens < 0:
            raise ValueError(f"queue bounds must be >= 0, got {max_requests}, {max_tokens}")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.retry_after_s = retry_after_s
        self._waiters: list[Waiter] = []  # by place: priority, then seq
        self._trying: Waiter | None = None
        self._has_news = False  # room may have freed since the last try began
        self._arrivals = itertools.count(1)
        self.num_tokens = 0  # prompt tokens of every waiter

    def __len__(self) -> int:
        return len(self._waiters)

    def __contains__(self, waiter: object) -> bool:
        return any(w is waiter for w in self._waiters)

    @property
    def waiters(self) -> list[Waiter]:
        """Every waiter, head first."""
        return list(self._waiters)

    @property
    def head(self) -> Waiter | None:
        return self._waiters[0] if self._waiters else None

    def arrive(self) -> int:
        """A request's arrival number (take one as it arrives, before it first tries)."""
        return next(self._arrivals)

    def is_first(self, priority: int) -> bool:
        """Whether a request of `priority` arriving now would be the head (no one waits ahead of
        it): then it tries at once."""
        return self.num_ahead(priority) == 0

    def num_ahead(self, priority: int) -> int:
        """Waiters a request of `priority` arriving now would wait behind."""
        return sum(1 for w in self._waiters if w.priority <= priority)

    def position(self, waiter: Waiter) -> int:
        """0 for the head."""
        return next(i for i, w in enumerate(self._waiters) if w is waiter)

    # ---- in and out --------------------------------------------------------------------------

    def push(
        self,
        waiter: Waiter,
        *,
        why: str = "requests ahead of it in the queue",
        retry_after_s: float | None = None,
        is_return: bool = False,
    ) -> None:
        """Queue `waiter` in its place (priority, then arrival); ResourceExhausted (nothing
        queued) past a bound.

        The token bound lets one waiter in whatever its size when the queue is empty: a bound
        below the longest prompt must not turn that prompt away for good. `why`: why it waits,
        quoted in the refusal; `retry_after_s`: the refusal's hint (None: the queue's).
        `is_return`: the waiter comes back after it was admitted (prefill turned it away), or is
        a later choice of a request taken with its first: where the queue takes any, it is not
        refused, or later arrivals queued meanwhile would keep their places over it (its place
        was counted when it arrived; returns are bounded by the requests in flight, choices by
        n).
        """
        if any(w.seq == waiter.seq for w in self._waiters):
            raise ValueError(f"arrival {waiter.seq} is queued already")
        if not is_return or self.max_requests == 0:  # 0: no waiting at all
            self._check_room(
                waiter, why, self.retry_after_s if retry_after_s is None else retry_after_s
            )
        bisect.insort(self._waiters, waiter, key=lambda w: w.place)
        self.num_tokens += waiter.num_tokens

    def _check_room(self, waiter: Waiter, why: str, retry_after_s: float | None) -> None:
        if len(self._waiters) >= self.max_requests:
            raise ResourceExhausted(
                f"{why}, and the admission queue is full ({len(self._waiters)} of "
                f"{plural(self.max_requests, 'request')} waiting); retry later",
                retry_after_s,
            )
        if self._waiters and self.num_tokens + waiter.num_tokens > self.max_tokens:
            waiting = plural(self.num_tokens, "prompt token")
            raise ResourceExhausted(
                f"{why}, and the admission queue is full ({waiting} waiting, "
                f"{waiter.num_tokens} more would pass its limit of {self.max_tokens}); retry later",
                retry_after_s,
            )

    def remove(self, waiter: Waiter) -> bool:
        """Take `waiter` out, however it leaves; False when it was not queued. A head that
        leaves gives the next waiter a turn."""
        if waiter not in self:
            return False
        was_head = self._waiters[0] is waiter
        self._waiters = [w for w in self._waiters if w is not waiter]
        self.num_tokens -= waiter.num_tokens
        if self._trying is waiter:
            self._trying = None
        if was_head:
            self._has_news = True
        return True

    # ---- turns -------------------------------------------------------------------------------

    def room(self) -> None:
        """Room may have freed on some instance."""
        self._has_news = True

    def take_turn(self) -> Waiter | None:
        """The waiter that should try now: the head, when no one is trying and room may have
        freed since the last try began. None otherwise."""
        head = self.head
        if head is None or self._trying is not None or not self._has_news:
            return None
        self._has_news = False
        self._trying = head
        return head

    def end_try(self, waiter: Waiter, *, is_admitted: bool) -> None:
        """The try `take_turn` gave `waiter` ended: admitted (it leaves; the next one may fit
        too) or not (it stays the head and waits for room)."""
        if self._trying is not waiter:
            raise ValueError(f"arrival {waiter.seq} is not trying")
        self._trying = None
        if is_admitted:
            self.remove(waiter)
            self._has_news = True  # the next waiter may fit too
