"""Token events and their hand-off from the batch thread to each request's Generate call.

    batch thread                                   event loop
    ────────────                                   ──────────
    step k: tokens for r1, r2, r3 ──deliver_threadsafe──▶ one loop.call_soon_threadsafe
                                                     └─▶ r1.stream.push(ev), r2..., r3...
                                                   Generate(r1): await stream.next()  -> Tokens

One `call_soon_threadsafe` per step (not per request) keeps the wake-ups of the loop to one per
step. A consumer that lags (slow client) is not a problem for the batch thread: events pile up
in the stream and the next `next()` returns all of them merged into one event, so a request
never holds more than its max_tokens worth of pending tokens.

A GenerateStream serves many requests from one task: instead of awaiting each stream's
`next()`, it `watch`es them (a callback marks the stream ready) and `take`s what is pending
from every ready stream once per wake-up, so one step's events go out in one message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mili.engine.logprobs import TokenLogprobs
from mili.engine.stop import FinishReason

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext


@dataclass(frozen=True)
class TokenEvent:
    """Tokens generated since the previous event of one request."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asked
    finish_reason: FinishReason | None = None  # set on the last event


def merge(events: Sequence[TokenEvent]) -> TokenEvent:
    """Events in order, as one: tokens concatenated, the last finish reason."""
    if len(events) == 1:
        return events[0]
    token_ids = [t for e in events for t in e.token_ids]
    has_logprobs = any(e.logprobs is not None for e in events)
    logprobs = [lp for e in events for lp in (e.logprobs or [])] if has_logprobs else None
    return TokenEvent(token_ids, logprobs, events[-1].finish_reason)


class TokenStream:
    """A request's events, read by its Generate call; written on the event loop's thread only.

    `loop` is where the reader runs; other threads reach the stream through `deliver_threadsafe`.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop
        self._pending: list[TokenEvent] = []
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._failed = asyncio.Event()
        self._on_ready: Callable[[], None] | None = None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def push(self, event: TokenEvent) -> None:
        self._pending.append(event)
        self._ready.set()
        if self._on_ready is not None:
            self._on_ready()

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` (after any tokens already pushed); the first error wins."""
        if self._error is None:
            self._error = error
            self._ready.set()
            self._failed.set()
            if self._on_ready is not None:
                self._on_ready()

    def watch(self, on_ready: Callable[[], None] | None) -> None:
        """Call `on_ready()` (on the loop's thread) whenever an event or the error arrives, for a
        reader that `take`s instead of awaiting `next`; at once if something is pending. None
        stops watching."""
        self._on_ready = on_ready
        if on_ready is not None and (self._pending or self._error is not None):
            on_ready()

    def take(self) -> TokenEvent | None:
        """Everything pushed since the last call, merged, without waiting (None: nothing yet);
        raises the stream's error once drained."""
        if self._pending:
            events, self._pending = self._pending, []
            self._ready.clear()
            return merge(events)
        if self._error is not None:
            raise self._error
        return None

    async def wait_failed(self) -> BaseException:
        """Return the stream's error once it has one (a transfer stops when its request ends)."""
        await self._failed.wait()
        assert self._error is not None
        return self._error

    async def next(self, timeout_s: float | None = None) -> TokenEvent:
        """Everything pushed since the last call, merged; raises the stream's error once drained.

        Raises TimeoutError when nothing arrives within `timeout_s` (None: wait forever).
        """
        if not self._pending and self._error is None:
            async with asyncio.timeout(timeout_s):
                await self._ready.wait()
        self._ready.clear()
        if self._pending:
            events, self._pending = self._pending, []
            return merge(events)
        assert self._error is not None
        raise self._error


@dataclass(eq=False)
class Outlet:
    """Where one admitted request's events go: its stream, and its `decode request` span when
    traced (batched steps link to it, mili.telemetry.tracing)."""

    stream: TokenStream
    span_context: SpanContext | None = None
    num_holders: int = 1  # the call carrying the request, and a KV transfer into it


class Outlets:
    """Request id -> Outlet, for the requests of one decode instance: the servicers' side of
    the request table (whose DecodeRequest holds no asyncio object). Event loop only.

    An entry is opened at admission and lives while the call carrying the request is open and
    while a KV transfer into the request runs (`hold`): a transfer that ends after its caller
    went away still reports the error the caller's stream got, as before. The batch thread
    keeps the outlets of the requests it runs (taken at `Batcher.join`)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Outlet] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def open(self, request_id: str, stream: TokenStream) -> Outlet:
        outlet = Outlet(stream)
        self._by_id[request_id] = outlet
        return outlet

    def of(self, request_id: str) -> Outlet:
        """The outlet of a request whose call is open or whose transfer holds it."""
        return self._by_id[request_id]

    def hold(self, request_id: str) -> Outlet:
        outlet = self._by_id[request_id]
        outlet.num_holders += 1
        return outlet

    def release(self, request_id: str, outlet: Outlet) -> None:
        """Let go of `open`'s or `hold`'s share; the entry goes with the last."""
        outlet.num_holders -= 1
        if outlet.num_holders == 0 and self._by_id.get(request_id) is outlet:
            del self._by_id[request_id]


Delivery = tuple[TokenStream, TokenEvent | BaseException]


def _deliver(items: list[Delivery]) -> None:
    for stream, item in items:
        if isinstance(item, BaseException):
            stream.fail(item)
        else:
            stream.push(item)


def deliver_threadsafe(items: list[Delivery]) -> None:
    """Hand events (or errors) to their streams from any thread: one loop wake-up per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}
    for stream, item in items:
        if stream.loop is not None:
            by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, group in by_loop.items():
        # RuntimeError: the loop is closed, the server stopped and nobody reads these streams.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_deliver, group)
