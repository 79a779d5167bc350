"""`calls.DecodeStream`s of one decode instance, all carried on one GenerateStream call.

    Generation r7 ─open──▶ starts [r7] ─┐  writer: one GenerateStreamRequest per wake-up,
    Generation r8 ─open──▶ starts [r8] ─┤          every start and cancel queued since the last
    Generation r3 ─cancel─▶ cancels [r3]┘          (more messages past 1 MiB: decode's limit)
                                           decode: one GenerateStreamResponse per step
    reader: events [r1 tokens, ..., r64 tokens] ──▶ each request's buffer; its reader woken

One message per decode step for all of this frontend's requests on the instance, instead of one
per request and token: that is what makes the token path cheap (docs/benchmarks.md, "Token
path"). Per request, nothing changes for the caller: `read()` returns the admission, then one
`Tokens` per message that carried tokens for it (decode merges what the request generated while
the stream lagged), then None; what waits is at most the request's max_tokens ids. A
request's error is raised as the domain error its own Generate call's status would give. The
call is opened on first use and again after it ended; when it fails, every request on it fails
with that error (InstanceDown when decode went away), and a new request opens a new call.
When the Info poller finds the instance stopped answering (hung, not dead: its connection stays
open, so the call would not fail until keepalive gives up), `cut` ends the call and fails its
requests at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
from typing import Any

import grpc
from opentelemetry import context as otel_context

from mili.pb.decode.v1 import decode_pb2, decode_pb2_grpc
from mili.rpc.policy import GENERATE_STREAM_BATCH_BYTES
from mili.rpc.status import DETAILS_KEY, server_status_of
from mili.telemetry.tracing import end_carried_call_span, start_carried_call_span
from services.frontend import convert
from services.frontend.calls import Admitted, Deadline, InstanceDown, Tokens
from services.frontend.downstream import error_from_status

_LOG = logging.getLogger("mili.frontend")
_GENERATE = "/mili.decode.v1.DecodeService/Generate"  # the call each request stands for


class DecodeMultiplexer:
    """Every request this frontend runs on one decode instance."""

    def __init__(self, stub: decode_pb2_grpc.DecodeServiceStub, who: str) -> None:
        self._stub = stub
        self._who = who  # "decode at HOST:PORT"
        self._session: _Session | None = None

    def open(self, request: decode_pb2.GenerateRequest, deadline: Deadline) -> RequestStream:
        """Start `request` on decode (sent with the next write); its events come through the
        returned stream."""
        if self._session is None or self._session.is_ended:
            # Opened outside the request's trace: the call outlives it and carries others (each
            # request sends its own trace context with its start).
            token = otel_context.attach(otel_context.Context())
            try:
                self._session = _Session(self._stub, self._who)
            finally:
                otel_context.detach(token)
        return self._session.open(request, deadline)

    def cut(self, error: InstanceDown) -> None:
        """The instance stopped answering: fail every request on the call with `error`
        (UNAVAILABLE) and cancel it; the next request opens a new one."""
        if self._session is not None and not self._session.is_ended:
            self._session.cut(error)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class RequestStream:
    """One request's events, as `calls.DecodeStream`; filled by its session's reader."""

    def __init__(self, session: _Session, request_id: str, deadline: Deadline) -> None:
        self._session = session
        self.request_id = request_id
        self.deadline = deadline
        self.span: Any = None  # its CLIENT span when traced (ended with its status)
        # Events not read yet, one per GenerateStreamResponse that carried one for this request
        # (as a Generate call's messages: the stop-string matcher and usage see the same
        # events); at most max_tokens token ids in all, since decode sends no more.
        self._events: collections.deque[Admitted | Tokens] = collections.deque()
        self._error: BaseException | None = None
        self._is_ended = False  # finished, failed or cancelled: nothing more comes
        self._waiter: asyncio.Future[None] | None = None

    async def read(self) -> Admitted | Tokens | None:
        if not (self._events or self._error or self._is_ended):
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._events:
            return self._events.popleft()
        if self._error is not None:
            raise self._error
        return None

    def cancel(self, why: str) -> None:
        """Stop decode's work on the request: `why` ends its span; "" when the frontend has
        the whole answer already (a stop string matched), which ends it OK."""
        if not self._is_ended:
            self._is_ended = True
            self._session.cancel(self)
            self._end_span(grpc.StatusCode.CANCELLED if why else grpc.StatusCode.OK, why)

    # ---- the session's side ------------------------------------------------------------------

    def deliver(self, event: Admitted | Tokens) -> None:
        self._events.append(event)
        if isinstance(event, Tokens) and event.finish_reason is not None:
            self._is_ended = True
            self._end_span(grpc.StatusCode.OK)
        self._wake()

    def fail(self, error: BaseException, code: grpc.StatusCode) -> None:
        if not self._is_ended:
            self._error = error
            self._is_ended = True
            self._end_span(code, str(error))
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _end_span(self, code: grpc.StatusCode, details: str | None = None) -> None:
        if self.span is not None:
            end_carried_call_span(self.span, code, details)
            self.span = None


class _Session:
    """One GenerateStream call and the requests open on it."""

    def __init__(self, stub: decode_pb2_grpc.DecodeServiceStub, who: str) -> None:
        self._who = who
        self._call: Any = stub.GenerateStream()  # no deadline: each request carries its own
        self._streams: dict[str, RequestStream] = {}
        self._starts: list[decode_pb2.StreamedGenerate] = []
        self._cancels: list[str] = []
        self._wake = asyncio.Event()
        self.is_ended = False
        self._writer = asyncio.create_task(self._write())
        self._reader = asyncio.create_task(self._read())

    def open(self, request: decode_pb2.GenerateRequest, deadline: Deadline) -> RequestStream:
        stream = RequestStream(self, request.request_id, deadline)
        stream.span, trace_context = start_carried_call_span(_GENERATE)
        remaining_s = deadline.remaining()
        timeout_ms = 0  # no deadline
        if remaining_s is not None:  # a uint32: remaining() is capped to fit
            timeout_ms = max(1, math.ceil(remaining_s * 1000))
        start = convert.streamed_generate(request, timeout_ms, trace_context)
        self._streams[request.request_id] = stream
        self._starts.append(start)
        self._wake.set()
        return stream

    def cancel(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            if self.is_ended:
                return
            rid = stream.request_id
            unsent = [s for s in self._starts if s.request.request_id != rid]
            if len(unsent) < len(self._starts):  # never sent: nothing for decode to undo
                self._starts = unsent
                return
            self._cancels.append(rid)
            self._wake.set()

    def cut(self, error: InstanceDown) -> None:
        self._end(error, grpc.StatusCode.UNAVAILABLE)
        self._call.cancel()  # the reader and the writer see it and return

    async def close(self) -> None:
        self.is_ended = True
        self._call.cancel()
        for task in (self._writer, self._reader):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _write(self) -> None:
        """Every start and cancel queued since the last write, in one message (more when they
        are over GENERATE_STREAM_BATCH_BYTES)."""
        while not self.is_ended:
            await self._wake.wait()
            self._wake.clear()
            if not (self._starts or self._cancels):
                continue
            messages = _messages(self._starts, self._cancels)
            self._starts, self._cancels = [], []
            try:
                for message in messages:
                    await self._call.write(message)
            except Exception:  # the call ended: the reader reports how, to every request
                return

    async def _read(self) -> None:
        streams = self._streams
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    self._end(
                        InstanceDown(f"{self._who} ended its GenerateStream (it is draining)"),
                        grpc.StatusCode.UNAVAILABLE,
                    )
                    return
                for event in response.events:
                    stream = streams.get(event.request_id)
                    if stream is None:
                        continue  # cancelled meanwhile
                    kind = event.WhichOneof("event")
                    if kind == "error":
                        del streams[event.request_id]
                        error = event.error
                        code = _code(error.code)
                        stream.fail(
                            error_from_status(
                                code,
                                error.message,
                                error.status_details,
                                self._who,
                                is_own_deadline_passed=stream.deadline.has_passed,
                            ),
                            code,
                        )
                        continue
                    converted = convert.streamed_event(event, kind)
                    if converted is None:
                        continue  # an event kind this version does not know
                    stream.deliver(converted)
                    if isinstance(converted, Tokens) and converted.finish_reason is not None:
                        del streams[event.request_id]
        except grpc.aio.AioRpcError as err:
            # A write racing the end can hide the server's status behind INTERNAL; it also
            # announced the status in its initial metadata (mili.rpc.status).
            code, details, trailers = server_status_of(err)
            self._end(error_from_status(code, details, _details(trailers), self._who), code)
        except asyncio.CancelledError:
            self._end(
                InstanceDown(f"{self._who}: the frontend is closing"), grpc.StatusCode.CANCELLED
            )
            raise
        except Exception as exc:  # a bug here must not leave requests waiting forever
            _LOG.exception("reading the GenerateStream of %s failed", self._who)
            self._end(exc, grpc.StatusCode.INTERNAL)

    def _end(self, error: BaseException, code: grpc.StatusCode) -> None:
        self.is_ended = True
        self._wake.set()  # the writer returns
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(error, code)


def _messages(
    starts: list[decode_pb2.StreamedGenerate], cancels: list[str]
) -> list[decode_pb2.GenerateStreamRequest]:
    """`starts` then `cancels`, in order, in messages of at most GENERATE_STREAM_BATCH_BYTES
    each (a start larger than that goes alone): decode refuses a larger GenerateStream message.
    Nearly always one message: 1 MiB holds thousands of short prompts' starts."""
    sizes = [start.ByteSize() + 8 for start in starts]  # + the entry's tag and length
    sizes += [len(rid.encode()) + 8 for rid in cancels]
    if sum(sizes) <= GENERATE_STREAM_BATCH_BYTES:
        return [decode_pb2.GenerateStreamRequest(starts=starts, cancel_request_ids=cancels)]
    messages = [decode_pb2.GenerateStreamRequest()]
    num_bytes = 0
    items: list[decode_pb2.StreamedGenerate | str] = [*starts, *cancels]
    for item, size in zip(items, sizes, strict=True):
        if num_bytes and num_bytes + size > GENERATE_STREAM_BATCH_BYTES:
            messages.append(decode_pb2.GenerateStreamRequest())
            num_bytes = 0
        if isinstance(item, str):
            messages[-1].cancel_request_ids.append(item)
        else:
            messages[-1].starts.append(item)
        num_bytes += size
    return messages


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _code(value: int) -> grpc.StatusCode:
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


def _details(trailers: tuple[tuple[str, str | bytes], ...]) -> bytes:
    return next((bytes(v) for k, v in trailers if k == DETAILS_KEY and isinstance(v, bytes)), b"")
