"""A SERVER span per traced gRPC call, ended with the call's final status.

Ours rather than opentelemetry-instrumentation-grpc's aio server interceptor, which
  - recorded a failed call's exception twice (itself, then again through
    `start_as_current_span` as the exception left it): two identical `exception` events;
  - ended a call grpc cut short (caller cancelled, deadline passed) as OK
    (`rpc.grpc.status_code` 0, the value it starts every span with): when grpc stops a
    response stream at a `yield`, the span's block exits with the generator unclosed, so the
    handler's own `finally` ran after the span had ended, if at all before garbage collection.

Here the handler's response generator is closed inside the span, and the span's status is
the call's as the client saw it:

    context.code() set (an abort: ours, the servicer's)   that code
    handler returned                                      OK
    else (grpc cut it)                                    mili.cut.cut_short

`rpc.grpc.status_code` carries the code; the span's status is ERROR for the codes the
OpenTelemetry gRPC conventions call a server's error (_SERVER_ERRORS) with `CODE: details`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from mili.cut import final_code
from mili.discovery import host_of
from mili.handler_kind import Behavior, rewrapped

# Server-side errors per the OpenTelemetry gRPC conventions: the others (INVALID_ARGUMENT,
# NOT_FOUND, CANCELLED, ...) are the caller's doing, left UNSET with their code attribute.
_SERVER_ERRORS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


class ServerSpans(grpc.aio.ServerInterceptor):
    """Put it first, so its span is current around every other interceptor."""

    def __init__(self, tracer: trace.Tracer, is_traced: Callable[[grpc.HandlerCallDetails], bool]):
        self._tracer = tracer
        self._is_traced = is_traced

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or not self._is_traced(handler_call_details):
            return handler
        method: str = handler_call_details.method
        wrapped = rewrapped(
            handler,
            lambda behavior: self._wrap_generator(behavior, method),
            lambda behavior: self._wrap_coroutine(behavior, method),
        )
        return handler if wrapped is None else wrapped

    def _wrap_coroutine(self, behavior: Behavior, method: str) -> Behavior:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with self._span(method, context) as span:
                is_done = False
                try:
                    response = await behavior(request, context)
                    is_done = True
                    return response
                except Exception as exc:
                    _record(span, exc)
                    raise
                finally:
                    _end_status(span, context, is_done)

        return run

    def _wrap_generator(self, behavior: Behavior, method: str) -> Behavior:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with self._span(method, context) as span:
                is_done = False
                responses = behavior(request, context)
                try:
                    async for response in responses:
                        yield response
                    is_done = True
                except Exception as exc:
                    _record(span, exc)
                    raise
                finally:
                    # grpc may stop iterating at a `yield` (cut call): close the handler's
                    # generator now, in the span, so its `finally` (an abort, its count) runs
                    # before the span ends.
                    await responses.aclose()
                    _end_status(span, context, is_done)

        return run

    @contextmanager
    def _span(self, method: str, context: grpc.aio.ServicerContext) -> Iterator[Span]:
        carrier = {key: value for key, value in context.invocation_metadata() or ()}
        service, _, name = method.lstrip("/").partition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
        caller = host_of(context.peer())
        if caller is not None:  # which frontend (or prefill) called: a unix socket has none
            attributes["network.peer.address"] = caller
        with self._tracer.start_as_current_span(
            method,
            context=propagate.extract(carrier),
            kind=SpanKind.SERVER,
            attributes=attributes,
            record_exception=False,  # _record does, once
            set_status_on_exception=False,  # _end_status does, from the call's code
        ) as span:
            yield span


def _record(span: Span, exc: Exception) -> None:
    """A servicer's exception, once; not an abort (the status path: its code is the span's)."""
    if not isinstance(exc, grpc.aio.AbortError):
        span.record_exception(exc)


def _end_status(span: Span, context: grpc.aio.ServicerContext, is_done: bool) -> None:
    code = final_code(context, is_done)
    if not isinstance(code, grpc.StatusCode):  # grpc keeps what abort was given
        span.set_attribute("rpc.grpc.status_code", int(code))
        return
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in _SERVER_ERRORS:
        details = context.details() or ""
        if not details and code is grpc.StatusCode.DEADLINE_EXCEEDED:
            details = "the caller's deadline passed"
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}"))
