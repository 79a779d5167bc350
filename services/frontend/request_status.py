"""Where each request of this frontend stands, by the caller's request id: pure bookkeeping
behind `GET /status/{request_id}`.

Every generation (gRPC Generate/Complete, HTTP /generate, the OpenAI endpoints) is tracked here
from the moment Generations.run takes it until it ends; the ended ones stay for a while:

    in flight    every request not ended yet: id -> its entries, oldest first (ids are the
                 callers' labels, so two callers may run "1" at once)
    completed    the last `max_completed` ids that ended, oldest first; an id that ends again
                 replaces its older entry and moves to the back; past the bound the oldest
                 falls out (FIFO)

A lookup reports the newest request (the last one started) under that id, in flight or ended.
The caller bumps `num_generated` once per delta: an integer add, no allocation per token.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Literal, NamedTuple

DEFAULT_MAX_COMPLETED = 1024

Status = Literal["processing", "completed", "not_found"]


class TrackedRequest:
    """One request's progress, updated in place by whoever runs it."""

    __slots__ = ("_seq", "finish_reason", "max_tokens", "num_generated", "request_id")

    def __init__(self, request_id: str, max_tokens: int, seq: int) -> None:
        self.request_id = request_id
        self.max_tokens = max_tokens  # lowered when the prompt leaves less room in the context
        self.num_generated = 0
        self.finish_reason: str | None = None  # set when it ended
        self._seq = seq  # start order: the larger, the newer


class StatusReport(NamedTuple):
    request_id: str
    status: Status
    num_generated: int
    # max_tokens - generated while processing; 0 once it ended (a request that stopped early
    # generates nothing more).
    num_remaining: int
    # stop | length (mili.engine.stop.FinishReason), cancelled (the caller went away or its
    # deadline passed) or error; None unless completed.
    finish_reason: str | None


class RequestStatuses:
    """The requests in flight and the last `max_completed` that ended."""

    def __init__(self, max_completed: int = DEFAULT_MAX_COMPLETED) -> None:
        if max_completed < 0:
            raise ValueError(f"max_completed must be >= 0, got {max_completed}")
        self.max_completed = max_completed
        self._in_flight: dict[str, list[TrackedRequest]] = {}
        self._completed: OrderedDict[str, TrackedRequest] = OrderedDict()
        self._seq = itertools.count()

    @property
    def num_in_flight(self) -> int:
        return sum(len(entries) for entries in self._in_flight.values())

    @property
    def num_completed(self) -> int:
        return len(self._completed)

    def start(self, request_id: str, max_tokens: int) -> TrackedRequest:
        """Track a request from now on; hand the result to `end` when it ends, whatever way."""
        entry = TrackedRequest(request_id, max_tokens, next(self._seq))
        self._in_flight.setdefault(request_id, []).append(entry)
        return entry

    def end(self, entry: TrackedRequest, finish_reason: str) -> None:
        """`entry` ended with `finish_reason`: it moves to the completed history."""
        entries = self._in_flight.get(entry.request_id)
        if entries is None or entry not in entries:
            raise ValueError(f"request {entry.request_id!r} is not in flight")
        entries.remove(entry)
        if not entries:
            del self._in_flight[entry.request_id]
        entry.finish_reason = finish_reason
        if self.max_completed == 0:
            return
        older = self._completed.pop(entry.request_id, None)
        # A request that ends after a newer one with its id did keeps the newer in the history.
        self._completed[entry.request_id] = (
            entry if older is None or older._seq < entry._seq else older
        )
        while len(self._completed) > self.max_completed:
            self._completed.popitem(last=False)

    def lookup(self, request_id: str) -> StatusReport:
        """The newest request under `request_id`; else, for an HTTP request with several
        choices (tracked per choice as `{id}.{i}`, their ids in logs and traces), its choices
        together: processing while one is, the tokens of all, the finish reason they share
        (else each choice's, in order, joined by ",")."""
        report = self._lookup(request_id)
        if report.status != "not_found":
            return report
        choices = []
        for i in itertools.count():
            choice = self._lookup(f"{request_id}.{i}")
            if choice.status == "not_found":
                break
            choices.append(choice)
        if not choices:
            return report
        reasons = [c.finish_reason or "" for c in choices]
        is_processing = any(c.status == "processing" for c in choices)
        reason = reasons[0] if len(set(reasons)) == 1 else ",".join(reasons)
        return StatusReport(
            request_id,
            "processing" if is_processing else "completed",
            sum(c.num_generated for c in choices),
            sum(c.num_remaining for c in choices),
            None if is_processing else reason,
        )

    def _lookup(self, request_id: str) -> StatusReport:
        running = self._in_flight.get(request_id)
        newest = running[-1] if running else None
        done = self._completed.get(request_id)
        if done is not None and (newest is None or done._seq > newest._seq):
            return StatusReport(request_id, "completed", done.num_generated, 0, done.finish_reason)
        if newest is not None:
            remaining = max(0, newest.max_tokens - newest.num_generated)
            return StatusReport(request_id, "processing", newest.num_generated, remaining, None)
        return StatusReport(request_id, "not_found", 0, 0, None)
