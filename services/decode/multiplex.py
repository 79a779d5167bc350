"""GenerateStream: one caller's requests on one stream, each as its own Generate call would be.

    caller (a frontend)                         this decode instance
    ───────────────────                         ────────────────────
    {starts: [r7, r8], cancel_request_ids: []} ──▶ admit each (admission.py): Admitted or error
                                                   r7.stream.watch(mark r7 ready) ...
                      batch thread, step k: r1..r64 ──deliver_threadsafe──▶ one loop wake-up
    ◀── {events: [r1 tokens, ..., r64 tokens]}      every ready stream `take`n: one message

Per request, exactly what a Generate call does: the same admission and refusals, tokens merged
while the caller lags (the stream's pending events, at most max_tokens of them), its deadline
(`timeout_ms`), its lease while the KV is awaited, refusal while draining, cancellation (the
caller's cancel_request_ids, or the stream ending) freeing its blocks within one step, its error
as a `RequestError` carrying the status the call would have ended with. Back-pressure is the
stream's: while the caller does not read, ready events wait in their request streams, merged,
and go out together once the previous message was taken.

Each request is counted in mili_requests_total as a Generate call with its final status, and
traced as one when the caller sent a trace context: a SERVER span named after Generate under the
caller's, with the `decode request` span beneath it as a Generate call has.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from mili.errors import Cancelled, DeadlineExceeded, InvalidArgument, Unavailable
from mili.pb.decode.v1 import decode_pb2
from mili.rpc.status import code_of, is_internal, status_of
from mili.telemetry.metrics import RequestMetrics
from services.decode import convert
from services.decode.admission import Admission, lease_expired
from services.decode.requests import DecodeRequest, RequestState, RequestTable
from services.decode.stream import Outlet, Outlets

_LOG = logging.getLogger("mili.decode")
_TRACER = trace.get_tracer("mili.decode")  # a no-op until tracing installs a provider

# The call each streamed request stands for: its name in metrics, spans and error messages.
GENERATE_METHOD = "/mili.decode.v1.DecodeService/Generate"
# While requests wait for their KV, the stream wakes this often to notice a drain (a draining
# server refuses new TransferKv calls, so a request still WAITING then never gets its KV).
_WAIT_POLL_S = 0.25
_KV_PENDING = (RequestState.WAITING, RequestState.TRANSFERRING)


@dataclass(eq=False)
class _Open:
    """A request open on the stream."""

    request: DecodeRequest
    outlet: Outlet
    span: Span | None  # the Generate SERVER span, when the caller's trace context came along
    request_span: Span  # `decode request`, a no-op span when not traced
    deadline: asyncio.TimerHandle | None
    num_tokens: int = 0


class Multiplexer:
    """One GenerateStream call: `run` reads the caller's messages and yields the events."""

    def __init__(
        self,
        admission: Admission,
        table: RequestTable,
        outlets: Outlets,
        *,
        metrics: RequestMetrics | None,
        is_draining: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._admission = admission
        self._table = table
        self._outlets = outlets
        self._metrics = metrics
        self._is_draining = is_draining
        self._clock = clock
        self._open: dict[str, _Open] = {}
        # Starts being admitted, each on a task of its own: one waiting for its constraint's
        # first compile holds back no other start or cancel on the stream.
        self._starting: dict[str, asyncio.Task[None]] = {}
        self._ready: dict[str, None] = {}  # ids with events to take, in the order they came
        self._outbox: list[decode_pb2.StreamedEvent] = []  # admissions and failures
        self._wake = asyncio.Event()
        self._is_caller_done = False  # the caller closed its side (or it failed)

    async def run(
        self, requests: AsyncIterator[decode_pb2.GenerateStreamRequest]
    ) -> AsyncGenerator[decode_pb2.GenerateStreamResponse, None]:
        reader = asyncio.create_task(self._read(requests))
        ticker = asyncio.create_task(self._tick())
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if reader.done() and not reader.cancelled() and reader.exception() is not None:
                    raise reader.exception()  # type: ignore[misc]
                events = self._collect()
                if events:
                    yield decode_pb2.GenerateStreamResponse(events=events)
                if not (self._open or self._starting) and (
                    self._is_caller_done or self._is_draining()
                ):
                    return  # nothing left to send, and nothing more will come
        finally:
            reader.cancel()
            ticker.cancel()
            for task in list(self._starting.values()):  # admitting: refused as cancelled
                task.cancel()
            for rid in list(self._open):  # the caller went away: as cancelling each call
                self._close(rid, Cancelled(f"the stream carrying request {rid} ended"))

    # ---- the caller's messages ---------------------------------------------------------------

    async def _read(self, requests: AsyncIterator[decode_pb2.GenerateStreamRequest]) -> None:
        try:
            async for message in requests:
                for start in message.starts:
                    rid = start.request.request_id
                    if rid in self._open or rid in self._starting:
                        # Open: ended in the table, its last events not yet sent. An error
                        # event for this id would read as the open request's end: the stream
                        # ends instead (`run` raises it), cancelling what is open on it.
                        reason = "already exists: a request with this id is open on this stream"
                        raise InvalidArgument("starts.request.request_id", rid, reason)
                    task = asyncio.create_task(self._start(start))
                    self._starting[rid] = task
                    task.add_done_callback(functools.partial(self._started, rid))
                for rid in message.cancel_request_ids:
                    if rid in self._open:
                        self._close(rid, Cancelled(f"request {rid} was cancelled by its caller"))
                    elif rid in self._starting:
                        self._starting[rid].cancel()
        finally:
            self._is_caller_done = True
            self._wake.set()

    def _started(self, rid: str, task: asyncio.Task[None]) -> None:
        """A start's task ended (also one cancelled before it ran, whose body never did): off
        `_starting`, and the stream woken to see whether anything is left on it."""
        if self._starting.get(rid) is task:
            del self._starting[rid]
        self._wake.set()

    async def _start(self, start: decode_pb2.StreamedGenerate) -> None:
        request = start.request
        rid = request.request_id
        span = self._server_span(start)
        try:
            if self._is_draining():
                raise Unavailable("decode instance is draining; retry on another instance")
            # refuses an id still active, open here or not
            req, outlet = await self._admission.admit(request)
        except asyncio.CancelledError:
            # The caller cancelled it, or the stream ended, while its constraint compiled: its
            # span and count end too.
            self._refuse(rid, Cancelled(f"request {rid} was cancelled while being admitted"), span)
            raise
        except Exception as exc:
            self._refuse(rid, exc, span)
            return
        request_span = _TRACER.start_span(
            "decode request",
            context=None if span is None else trace.set_span_in_context(span),
            attributes={
                "mili.request_id": rid,
                "mili.client_request_id": request.client_request_id,
                "mili.decode.num_prompt_tokens": len(req.prompt_token_ids),
                "mili.decode.num_blocks": len(req.block_table),
                # leading prompt blocks taken from the prefix cache (not sent by prefill)
                "mili.decode.num_cached_blocks": req.num_cached_blocks,
            },
        )
        if request_span.is_recording():  # batched steps link to this span
            outlet.span_context = request_span.get_span_context()
        deadline = None
        if start.timeout_ms:
            loop = asyncio.get_running_loop()
            deadline = loop.call_later(start.timeout_ms / 1000, self._deadline_passed, rid)
        self._open[rid] = _Open(req, outlet, span, request_span, deadline)
        self._outbox.append(convert.streamed_admitted(req))
        self._wake.set()
        outlet.stream.watch(lambda: self._mark_ready(rid))

    def _server_span(self, start: decode_pb2.StreamedGenerate) -> Span | None:
        if not start.trace_context:
            return None
        span = _TRACER.start_span(
            GENERATE_METHOD,
            context=propagate.extract(dict(start.trace_context)),
            kind=SpanKind.SERVER,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": "mili.decode.v1.DecodeService",
                "rpc.method": "Generate",
                "mili.decode.multiplexed": True,
            },
        )
        return span if span.is_recording() else None

    # ---- events ------------------------------------------------------------------------------

    def _mark_ready(self, rid: str) -> None:
        self._ready[rid] = None
        self._wake.set()

    def _collect(self) -> list[decode_pb2.StreamedEvent]:
        """Admissions and failures so far, then every ready request's pending tokens."""
        events, self._outbox = self._outbox, []
        ready, self._ready = self._ready, {}
        for rid in ready:
            entry = self._open.get(rid)
            if entry is None:
                continue
            try:
                event = entry.outlet.stream.take()
            except Exception as exc:  # the request failed: lease, transfer, batch, shutdown
                events.append(convert.streamed_error(rid, _status_of(exc)))
                self._close(rid, exc)
                continue
            if event is None:
                continue
            if not entry.num_tokens and entry.request_span.is_recording():
                entry.request_span.add_event("first token")  # prefill's, once the KV landed
            entry.num_tokens += len(event.token_ids)
            if event.finish_reason and entry.request_span.is_recording():
                entry.request_span.set_attribute(
                    "mili.decode.finish_reason", str(event.finish_reason)
                )
            events.append(convert.streamed_tokens(rid, event))
            if event.finish_reason:
                self._close(rid, None)
            elif entry.outlet.stream.error is not None:
                # Failed after these tokens (one delivery may carry both, and the stream says
                # so only once): take() raises it on the next collection.
                self._mark_ready(rid)
        return events

    def _refuse(self, rid: str, exc: BaseException, span: Span | None) -> None:
        """A request that was never admitted: its error now, nothing to free."""
        if is_internal(exc):
            _LOG.error("admitting request %s failed", rid, exc_info=exc)
        self._outbox.append(convert.streamed_error(rid, _status_of(exc)))
        self._wake.set()
        self._record(exc)
        if span is not None:
            _end_span(span, code_of(exc))

    def _deadline_passed(self, rid: str) -> None:
        if rid not in self._open:
            return
        error = DeadlineExceeded(f"the deadline of request {rid} passed")
        self._outbox.append(convert.streamed_error(rid, _status_of(error)))
        self._wake.set()
        self._close(rid, error)

    def _close(self, rid: str, error: BaseException | None) -> None:
        """The request ended (None: finished): free what it holds, as a Generate call's end."""
        entry = self._open.pop(rid)
        req, stream = entry.request, entry.outlet.stream
        stream.watch(None)
        if entry.deadline is not None:
            entry.deadline.cancel()
        # Cancelled, deadline, caller gone: free the blocks (a RUNNING request leaves the batch
        # within one step). A no-op when the request already ended.
        if self._table.cancel(req):
            # Tells a transfer still streaming into its blocks to stop.
            stream.fail(Cancelled(f"request {req.name} was cancelled by its caller"))
        self._outlets.release(rid, entry.outlet)
        if entry.request_span.is_recording():
            entry.request_span.set_attribute("mili.decode.num_output_tokens", entry.num_tokens)
        entry.request_span.end()
        self._record(error)
        if entry.span is not None:
            _end_span(entry.span, grpc.StatusCode.OK if error is None else code_of(error))
        if error is not None and is_internal(error):
            _LOG.error("request %s failed", req.name, exc_info=error)

    def _record(self, error: BaseException | None) -> None:
        if self._metrics is not None:
            code = grpc.StatusCode.OK if error is None else code_of(error)
            self._metrics.record(GENERATE_METHOD, code.name)

    # ---- requests waiting for their KV -------------------------------------------------------

    async def _tick(self) -> None:
        """Expire leases and refuse waiting requests on a drain, as each Generate call does."""
        while True:
            now = self._clock()
            waiting = [e for e in self._open.values() if e.request.state in _KV_PENDING]
            for req, stream in ((e.request, e.outlet.stream) for e in waiting):
                if req.state is RequestState.WAITING and self._is_draining():
                    if self._table.cancel(req):
                        stream.fail(Unavailable("decode instance is draining; retry elsewhere"))
                elif now >= req.lease_deadline and self._table.expire(req, now):
                    # The transfer still running, if any, reports the same error.
                    stream.fail(lease_expired(req))
            if self._is_draining():
                self._wake.set()  # ends the stream once nothing is left on it
            soonest = min((e.request.lease_deadline for e in waiting), default=now + _WAIT_POLL_S)
            await asyncio.sleep(min(_WAIT_POLL_S, max(0.0, soonest - now)))


def _status_of(exc: BaseException) -> grpc.Status:
    return status_of(exc, GENERATE_METHOD)


def _end_span(span: Span, code: grpc.StatusCode) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()
