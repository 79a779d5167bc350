"""The server interceptor every MILI service runs behind.

For each call it
  (a) turns an exception raised by the servicer into its status (see `mili.rpc.status`); calls
      the servicer already ended with `context.abort` pass through untouched,
  (b) refuses a request whose bytes do not parse with INVALID_ARGUMENT, and a request message
      over its method's size limit with RESOURCE_EXHAUSTED before parsing it, each with one
      WARNING line (see `mili.rpc.malformed`), instead of grpc's UNKNOWN and a traceback per
      call or millions of parsed ids,
  (g) refuses a caller the method's Callers do not admit (its service's Policy, see
      `mili.rpc.policy`) with PERMISSION_DENIED and one WARNING line, before the servicer runs
      and before a request stream's first message is read,
  (c) counts the call as in flight until its handler returns, so a drain knows when to stop,
  (d) refuses it with UNAVAILABLE once the server is draining, so clients retry elsewhere,
  (e) counts it once, by service, method and final status code, before its caller can see
      that status: the code it was aborted with (counted before the abort sends it), OK when
      the handler returned, else CANCELLED or DEADLINE_EXCEEDED; a call
      with one request message that grpc ended before the handler ran is REQUEST_UNREAD, with
      one INFO line (see `_count_unread`),
  (f) when the client streams requests, announces the status it fails with (a, b, d, g) in the
      initial metadata too, where a client whose write raced the status still finds it (see
      `mili.rpc.status.status_header`; a servicer's own `context.abort` does not get this).
Three kinds of call:

    traffic          everything else           (a)-(g), in mili_requests_total
    control          every service's Info      (a)-(g), in mili_control_requests_total
    infrastructure   health, reflection        (a), (b), (e) in mili_control_requests_total;
                                               never in flight, never refused, so a load
                                               balancer can watch a draining server go
                                               NOT_SERVING

Handlers must be coroutines or async generators (the event loop never blocks). A plain `def`
handler is passed through unwrapped: grpc runs it in its thread pool with its own error handling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from opentelemetry import trace

from mili.cut import cut, final_code, taken_back
from mili.discovery import Callers
from mili.errors import PermissionDenied
from mili.handler_kind import Behavior, rewrapped
from mili.rpc.malformed import CheckedRequests, Malformed, Oversized, Refused, guard
from mili.rpc.policy import OPEN, SMALL_REQUEST_BYTES, Policy
from mili.rpc.status import is_internal, status_header, status_of
from mili.telemetry.metrics import RequestMetrics

_LOG = logging.getLogger("mili.rpc")

# Method paths start with "/<service>/"; these services keep answering while we drain.
_INFRASTRUCTURE = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
# Every MILI service has an Info RPC: a cheap read of its state that the frontend polls on each
# instance every --poll-interval (and tracing leaves untraced for the same reason).
_CONTROL_SUFFIX = "/Info"
# The status label of a call grpc ended before its handler could read the request (see
# `CallInterceptor._count_unread`): not a gRPC code, since the server cannot tell which it was.
_REQUEST_UNREAD = "REQUEST_UNREAD"


class CallInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions to statuses, counts in-flight calls and gates new ones while draining.

    `name` is the service's short name ("tokenizer", "prefill", ...) used in messages.
    """

    def __init__(self, name: str, metrics: RequestMetrics) -> None:
        self._name = name
        self._metrics = metrics
        self._num_in_flight = 0
        self._is_draining = False
        self._idle: asyncio.Event | None = None  # made on first wait, inside the running loop
        self._policies: Mapping[str, Policy] = {}  # by service name; the others: OPEN
        self._receive_limit = SMALL_REQUEST_BYTES  # the server's: grpc refuses more itself
        # Calls whose handler has not started yet, by the task grpc runs each in (see `_wrap`).
        self._unstarted: dict[asyncio.Task[Any], _Call] = {}
        # The tasks of the application calls in flight (what `cut` cancels).
        self._running: set[asyncio.Task[Any]] = set()

    def set_policies(self, policies: Mapping[str, Policy], receive_limit: int) -> None:
        """Each service's rules, by its full name, and the server's receive limit (before the
        server starts)."""
        self._policies = dict(policies)
        self._receive_limit = receive_limit

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @property
    def is_draining(self) -> bool:
        return self._is_draining

    def start_draining(self) -> None:
        """From now on every new application call is refused with UNAVAILABLE."""
        self._is_draining = True

    def cut(self, why: str) -> int:
        """Cancel every application call in flight with `why` (mili.cut): each ends UNAVAILABLE
        with it as details. Returns how many were cut."""
        return cut(list(self._running), why)

    async def wait_idle(self) -> None:
        """Return once no application call is in flight (callers bound this with a timeout)."""
        while self._num_in_flight > 0:
            if self._idle is None or self._idle.is_set():
                self._idle = asyncio.Event()
            await self._idle.wait()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # grpc answers UNIMPLEMENTED itself
        method: str = handler_call_details.method
        return self._wrap(handler, method)

    # ---- wrapping ----------------------------------------------------------------------------

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        is_infrastructure = method.startswith(_INFRASTRUCTURE)
        service, _, name = method.lstrip("/").partition("/")
        policy = self._policies.get(service, OPEN)
        max_request_bytes = policy.request_bytes(name, self._receive_limit)
        if is_infrastructure:
            max_request_bytes = SMALL_REQUEST_BYTES
        call = _Call(
            method,
            is_gated=not is_infrastructure,
            is_control=is_infrastructure or method.endswith(_CONTROL_SUFFIX),
            is_request_streaming=handler.request_streaming,
            callers=None if is_infrastructure else policy.callers.get(name),
        )
        wrapped = rewrapped(
            handler,
            lambda behavior: self._wrap_generator(behavior, call),
            lambda behavior: self._wrap_coroutine(behavior, call),
            guard(
                handler.request_deserializer,
                max_request_bytes,
                is_request_streaming=handler.request_streaming,
            ),
        )
        if wrapped is None:
            return handler
        if not handler.request_streaming:
            # grpc reads a unary request between this and the handler, in this same task, and
            # ends the call without running the handler when that read fails.
            task = asyncio.current_task()
            if task is not None:
                self._unstarted[task] = call
                task.add_done_callback(self._count_unread)
        return wrapped

    def _wrap_coroutine(self, behavior: Behavior, call: _Call) -> Behavior:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self._start()
            await self._admit(context, call)
            task = self._enter(call)  # no await between admit and here: nothing can slip in
            tally = _Tally(self._metrics, call)
            is_done = False
            try:
                await self._check_caller(context, call)
                request = await self._checked(request, context, call, tally)
                response = await behavior(request, context)
                is_done = True
                return response
            except grpc.aio.AbortError:
                raise  # the servicer chose its status with context.abort
            except asyncio.CancelledError as exc:
                await self._answer_cut(exc, context, call, tally)
            except Exception as exc:
                _raise_if_refused(request)
                request = None  # its traceback holds this frame: the request must not stay
                await self._abort_with(exc, context, call, tally)
            finally:
                _count(tally, context, is_done)
                self._leave(call, task)

        return run

    def _wrap_generator(self, behavior: Behavior, call: _Call) -> Behavior:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            self._start()
            await self._admit(context, call)
            task = self._enter(call)
            tally = _Tally(self._metrics, call)
            is_done = False
            responses: Any = None
            try:
                await self._check_caller(context, call)
                request = await self._checked(request, context, call, tally)
                responses = behavior(request, context)
                async for response in responses:
                    yield response
                is_done = True
            except grpc.aio.AbortError:
                raise
            except asyncio.CancelledError as exc:
                await self._answer_cut(exc, context, call, tally)
            except Exception as exc:
                _raise_if_refused(request)
                request = None  # its traceback holds this frame: the request must not stay
                await self._abort_with(exc, context, call, tally)
            finally:
                # Counted before grpc sends the status (an abort: before it, in _abort): a
                # caller that saw it can see the count.
                _count(tally, context, is_done)
                # If grpc stops iterating early (cancelled call), close the servicer's generator
                # now so its `finally` blocks (freeing KV blocks, say) run at once, not at GC.
                if responses is not None:
                    await responses.aclose()
                self._leave(call, task)

        return run

    async def _check_caller(self, context: grpc.aio.ServicerContext, call: _Call) -> None:
        """PermissionDenied unless the method takes calls from this caller."""
        callers = call.callers
        if callers is None:
            return
        peer = context.peer()
        if await callers.admits(peer):
            return
        # One line, no traceback: a caller to name with the flag, or one to keep out.
        _LOG.warning(
            "%s: refused %s from %s: it takes calls from %s", self._name, call.method, peer, callers
        )
        hint = "" if callers.peers is not None else f" (name its host with {callers.flag})"
        raise PermissionDenied(
            f"{call.method} takes calls only from {callers}; {peer} is not one{hint}"
        )

    async def _checked(
        self, request: Any, context: grpc.aio.ServicerContext, call: _Call, tally: _Tally
    ) -> Any:
        """The request to hand the servicer: a unary one that is over its limit or did not parse
        is refused here; a request stream is checked message by message as the servicer reads
        it."""

        async def refuse(refused: Refused) -> NoReturn:
            await self._refuse(refused, context, call, tally)

        if call.is_request_streaming:
            return CheckedRequests(request, refuse)
        if isinstance(request, Malformed | Oversized):
            await refuse(request)
        return request

    # ---- helpers -----------------------------------------------------------------------------

    def _start(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._unstarted.pop(task, None)

    def _count_unread(self, task: asyncio.Task[Any]) -> None:
        """The task of a call with one request message ended: count it if its handler never ran.

        grpc.aio then failed to read the request and ended the call itself: the message was
        over the server's receive limit (the caller got RESOURCE_EXHAUSTED), or the caller
        cancelled or its deadline passed before the message arrived. grpc.aio tells the server
        neither which (the read just returns nothing) nor the caller's address, so the call is
        counted under its own status, REQUEST_UNREAD, and logged as such."""
        call = self._unstarted.pop(task, None)
        if call is None:
            return
        self._metrics.record(call.method, _REQUEST_UNREAD, is_control=call.is_control)
        _LOG.info(
            "%s: %s ended before its request was read: larger than the receive limit, or the "
            "caller cancelled or its deadline passed first",
            self._name,
            call.method,
        )

    async def _admit(self, context: grpc.aio.ServicerContext, call: _Call) -> None:
        if self._is_draining and call.is_gated:
            self._metrics.record(
                call.method, grpc.StatusCode.UNAVAILABLE.name, is_control=call.is_control
            )
            await _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"{self._name} is draining; retry on another instance",
                (),
                call.is_request_streaming,
                None,  # counted above: the call never enters the handler's count
            )

    async def _answer_cut(
        self,
        exc: asyncio.CancelledError,
        context: grpc.aio.ServicerContext,
        call: _Call,
        tally: _Tally,
    ) -> NoReturn:
        """A call this server cut short (mili.cut) ends UNAVAILABLE saying why; any other
        cancellation (the caller's, grpc's own) stays one."""
        why = taken_back(exc)
        if why is None:
            raise exc
        code = grpc.StatusCode.UNAVAILABLE
        await _abort(context, code, str(why), (), call.is_request_streaming, tally)

    def _enter(self, call: _Call) -> asyncio.Task[Any] | None:
        """Count the call in flight; its task (None for an ungated call), for `_leave`."""
        if not call.is_gated:
            return None
        self._num_in_flight += 1
        task = asyncio.current_task()
        if task is not None:
            self._running.add(task)
        return task

    def _leave(self, call: _Call, task: asyncio.Task[Any] | None) -> None:
        if not call.is_gated:
            return
        if task is not None:
            self._running.discard(task)
        self._num_in_flight -= 1
        if self._num_in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def _refuse(
        self, refused: Refused, context: grpc.aio.ServicerContext, call: _Call, tally: _Tally
    ) -> NoReturn:
        method = call.method
        peer = context.peer()
        if isinstance(refused, Oversized):
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            size = f"is {refused.num_bytes} bytes, over its limit of {refused.max_bytes} bytes"
            details, line = f"request to {method} {size}", f"request to {method} from {peer} {size}"
        else:
            code = grpc.StatusCode.INVALID_ARGUMENT
            details = f"malformed request to {method}: {refused.reason}"
            line = f"malformed request to {method} from {peer}: {refused.reason}"
        # One line, no traceback: the caller's mistake (or probe), not our bug.
        _LOG.warning("%s: %s", self._name, line)
        await _abort(context, code, details, (), call.is_request_streaming, tally)

    async def _abort_with(
        self, exc: Exception, context: grpc.aio.ServicerContext, call: _Call, tally: _Tally
    ) -> NoReturn:
        method = call.method
        status = status_of(exc, method)
        # The call's span (mili.telemetry.server_spans) records what it failed with, once:
        # outside this interceptor only the abort shows, not the servicer's exception.
        trace.get_current_span().record_exception(exc)
        if is_internal(exc):
            # The one place a bug's traceback is logged; the caller only gets a pointer to it.
            _LOG.error("%s: %s", self._name, status.details, exc_info=exc)
        else:
            _LOG.debug("%s %s -> %s: %s", self._name, method, status.code.name, status.details)
        _drop_tracebacks(exc)
        await _abort(
            context,
            status.code,
            status.details,
            status.trailing_metadata,
            call.is_request_streaming,
            tally,
        )


@dataclass(frozen=True)
class _Call:
    """How the interceptor treats calls to one method (see the module docstring)."""

    method: str  # /pkg.Service/Method
    is_gated: bool  # refused while draining, counted in flight
    is_control: bool  # counted in mili_control_requests_total, not mili_requests_total
    is_request_streaming: bool
    callers: Callers | None  # who may call it; None: any caller that reaches the port


class _Tally:
    """One call's count by final status, recorded once: as this interceptor aborts it, before
    the status goes out (grpc sends it inside `context.abort`, so a count made after, as the
    handler's `finally` ran, could miss a caller who had seen its status and scraped), else
    when its handler ends (`_count`)."""

    def __init__(self, metrics: RequestMetrics, call: _Call) -> None:
        self._metrics = metrics
        self._call = call
        self._is_recorded = False

    def record(self, status: str) -> None:
        if not self._is_recorded:
            self._is_recorded = True
            self._metrics.record(self._call.method, status, is_control=self._call.is_control)


def _count(tally: _Tally, context: grpc.aio.ServicerContext, is_done: bool) -> None:
    """Record the call's final status (a no-op once `_abort` did): the one set by an abort,
    else OK when its handler returned, else it was cut short (caller gone, deadline)."""
    code = final_code(context, is_done)
    tally.record(code.name if isinstance(code, grpc.StatusCode) else str(code))


def _drop_tracebacks(exc: BaseException) -> None:
    """Forget the tracebacks of `exc` and the exceptions it chains, once its status is known.

    Their frames hold the request (the servicer's, the conversion's) and grpc keeps the abort
    that chains `exc` in a reference cycle: a refused 7.5 MB request used to stay in memory
    until a full garbage collection, ~120 MB each. (Not traceback.clear_frames: clearing the
    frame of a coroutine still suspended, which a re-raised stored error can hold, closes it.)"""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        chained = pending.pop()
        if chained is None or id(chained) in seen:
            continue
        seen.add(id(chained))
        chained.__traceback__ = None
        pending += [chained.__cause__, chained.__context__]


def _raise_if_refused(request: Any) -> None:
    """A streamed request was refused as malformed and the servicer turned grpc's AbortError
    into another exception: the status is sent; hand grpc back its own AbortError."""
    if isinstance(request, CheckedRequests) and request.abort is not None:
        raise request.abort


async def _abort(
    context: grpc.aio.ServicerContext,
    code: grpc.StatusCode,
    details: str,
    trailing_metadata: Any,
    is_request_streaming: bool,
    tally: _Tally | None,
) -> NoReturn:
    """End the call with this status, counted first (`tally`, None when counted already);
    first announce it in the initial metadata when the client streams requests (a write of
    theirs racing the status would lose it, see mili.rpc.status)."""
    if tally is not None:
        tally.record(code.name)
    if is_request_streaming:
        # Fails when the initial metadata already went out (a bidi call that had answered) or
        # the call is over (the client went away): the status alone is all we can still send.
        with contextlib.suppress(Exception):
            await context.send_initial_metadata(status_header(code, details, trailing_metadata))
    try:
        await context.abort(code, details, trailing_metadata)
    except grpc.aio.AbortError:
        raise
    except Exception:
        # The call ended in grpc core while the status was on its way (the caller's deadline
        # passed or it went away at that moment): nobody is left to tell. grpc.aio would log
        # this send failure as an error with a traceback; ending the call as cancelled is what
        # it is, and grpc.aio takes that quietly.
        _LOG.debug("%s: the call ended before its status %s could be sent", code.name, details)
        raise asyncio.CancelledError from None
    raise AssertionError("context.abort returned")  # it always raises AbortError
