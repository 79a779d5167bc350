"""The landing side of one KV transfer, below the gRPC servicer (services/decode/transfer.py):
its chunks checked and copied on the landing threads by the pair's transport (`Landing`,
mili.kv_handoff; each thread copies and checks on its own CUDA stream, pinned.thread_stream),
its messages read by a future that outlives a wait for it (`Reader`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Generic, TypeVar

M = TypeVar("M")


class Landing:
    """One transfer's chunks being checked and scattered on the landing threads.

    The loop submits jobs in seq order and never cancels one: each job unpins its request
    itself, so the blocks stay held until its copy is over whatever happens to the call. The
    first job to fail sets `failed` (its result is the exception), which the loop watches.
    """

    def __init__(self, executor: Executor, max_bytes: int) -> None:
        self._executor = executor
        self._max_bytes = max_bytes
        self._in_flight: dict[asyncio.Future[None], int] = {}  # job -> payload bytes
        self._num_bytes = 0
        self._is_aborted = threading.Event()
        self.failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    async def make_room(self, num_bytes: int) -> None:
        """Until the bytes in flight leave room for `num_bytes` more (or nothing is in flight);
        raises the failure of an earlier job, if any."""
        self.raise_failure()
        while self._in_flight and self._num_bytes + num_bytes > self._max_bytes:
            await asyncio.wait(self._in_flight, return_when=asyncio.FIRST_COMPLETED)
            self.raise_failure()

    def submit(self, job: Callable[[], None], num_bytes: int) -> None:
        """Run `job` on a landing thread. Once this returns, the job runs whatever happens to
        the call: it must release what it holds itself. It may check `is_aborted`."""
        future = asyncio.wrap_future(self._executor.submit(job))
        self._in_flight[future] = num_bytes
        self._num_bytes += num_bytes
        future.add_done_callback(self._landed)

    async def wait_all(self) -> None:
        """Until every submitted job is over; raises the first failure as soon as it comes."""
        if self._in_flight:
            # asyncio.wait, not gather: cancelling this call must not cancel a job.
            await asyncio.wait(self._in_flight, return_when=asyncio.FIRST_EXCEPTION)
        self.raise_failure()

    def raise_failure(self) -> None:
        if self.failed.done():
            raise self.failed.result()

    def abort(self) -> None:
        """The transfer is over (failed or cancelled): jobs not started yet may skip their work."""
        self._is_aborted.set()

    def is_aborted(self) -> bool:
        return self._is_aborted.is_set()

    def _landed(self, future: asyncio.Future[None]) -> None:
        self._num_bytes -= self._in_flight.pop(future)
        error = None if future.cancelled() else future.exception()
        if error is not None and not self.failed.done():
            self.failed.set_result(error)


class Reader(Generic[M]):
    """The transfer's messages, read one at a time by a task that may outlive a wait for it:
    a read given up on (the request failed meanwhile) stays pending for `drain`. Cancelling it
    instead would close grpc's request stream under a sender still writing."""

    def __init__(self, messages: AsyncIterator[M]) -> None:
        self._messages = messages
        self._pending: asyncio.Future[M | None] | None = None

    def next(self) -> asyncio.Future[M | None]:
        """The next message (None: the stream ended); the same future until it is taken."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(anext(self._messages, None))
        return self._pending

    def take(self) -> M | None:
        read, self._pending = self.next(), None
        return read.result()

    async def drain(self) -> None:
        """Read and drop the rest until the sender half-closes (an in-place sender commits
        after its last write) or goes away (the call's cancellation ends the wait)."""
        while True:
            await asyncio.wait({self.next()})
            if self.take() is None:
                return

    def cancel(self) -> None:
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()  # the handler is ending: nobody reads this stream again
