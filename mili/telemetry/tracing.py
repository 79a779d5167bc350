"""OpenTelemetry tracing for every MILI process: start-up, gRPC interceptors, small span helpers.

    run(args) ──TracingConfig.from_args(args, os.environ, "frontend")──▶ setup_tracing(config)
        off: returns a `Tracing` with no provider; every interceptor list is empty and the
             spans made through `opentelemetry.trace` are the API's no-op ones (nothing exported)
        on:  a TracerProvider (sampler from OTEL_TRACES_SAMPLER/_ARG, read by the SDK here),
             a BatchSpanProcessor to OTLP/gRPC and/or the console, installed globally
    RpcServer(..., interceptors=tracing.server_interceptors())    a SERVER span per call
    insecure_channel(..., interceptors=tracing.client_interceptors())  a CLIENT span per call,
             W3C `traceparent` in the call's metadata
    ... SIGTERM, drain ... tracing.shutdown()     flushes what the batch processor holds

One Generate call is one trace:

    frontend  generate {model}
                ├─ CLIENT Tokenize ──▶ tokenizer SERVER Tokenize
                ├─ CLIENT decode Generate ──▶ decode SERVER Generate
                │                               └─ decode request  ◀╌╌ links ╌╌ decode step
                └─ CLIENT Prefill ──▶ prefill SERVER Prefill
                                        ├─ prefill compute  ◀╌╌ links ╌╌ prefill step
                                        └─ kv transfer ─ CLIENT TransferKv
                                             ──▶ decode SERVER TransferKv

A batched step serves many requests, so its span is a root that *links* to each request's
span instead of claiming one of them as its parent.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Setter
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode

_LOG = logging.getLogger("mili.telemetry")

# Infrastructure calls never make spans: health checks and reflection are polled constantly.
_UNTRACED_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
_TRACEPARENT = "traceparent"
# Server methods traced only when the call carries a trace context (see _is_traced_call):
# background polls, per-token streams, and the streams that carry many requests (each request
# on a GenerateStream is traced on its own, from the context it was started with).
_CONTEXT_ONLY_SUFFIXES = ("/Info", "/DetokenizeStream", "/GetTokenizerFile", "/GenerateStream")


@dataclass(frozen=True)
class TracingConfig:
    """Where a process's spans go; built once at start-up. No endpoint and no console = off."""

    service_name: str  # resource service.name, e.g. "mili-frontend"
    otlp_endpoint: str | None = None  # OTLP/gRPC, e.g. "http://127.0.0.1:4317"
    is_console: bool = False  # also print finished spans to stderr

    def __post_init__(self) -> None:
        if not self.service_name:
            raise ValueError("service_name must be set")
        if self.otlp_endpoint is not None and not self.otlp_endpoint:
            raise ValueError("otlp_endpoint must be a URL or None")

    @property
    def is_enabled(self) -> bool:
        return self.otlp_endpoint is not None or self.is_console

    @classmethod
    def from_args(cls, args: Any, environ: Mapping[str, str], service: str) -> TracingConfig:
        """From --otlp-endpoint / --trace-console and the standard OTEL_* variables.

        The flag wins over OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, which wins over
        OTEL_EXPORTER_OTLP_ENDPOINT; OTEL_SDK_DISABLED=true turns everything off;
        OTEL_SERVICE_NAME replaces the default "mili-<service>".
        """
        if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls(service_name=f"mili-{service}")
        endpoint = (
            getattr(args, "otlp_endpoint", None)
            or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
            or None
        )
        return cls(
            service_name=environ.get("OTEL_SERVICE_NAME") or f"mili-{service}",
            otlp_endpoint=endpoint,
            is_console=bool(getattr(args, "trace_console", False)),
        )


class Tracing:
    """What `setup_tracing` installed; `provider` is None when tracing is off."""

    def __init__(self, provider: Any | None) -> None:
        self.provider = provider  # opentelemetry.sdk.trace.TracerProvider when on

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """[] when off; else the server span interceptor (put it first, so its span also sees
        the status our error-mapping interceptor sets)."""
        if self.provider is None:
            return []
        from mili.telemetry.server_spans import ServerSpans

        return [ServerSpans(self.provider.get_tracer("mili.rpc.server"), _is_traced_call)]

    def client_interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """[] when off; else interceptors that span and propagate every call kind."""
        if self.provider is None:
            return []
        return client_interceptors(self.provider.get_tracer("mili.rpc.client"))

    def shutdown(self) -> None:
        """Flush and stop exporting (after the server drained); a no-op when off."""
        if self.provider is not None:
            self.provider.shutdown()  # BatchSpanProcessor.shutdown exports what it holds
            self.provider = None


def setup_tracing(config: TracingConfig) -> Tracing:
    """Install a global TracerProvider exporting as `config` says, or nothing when it is off.

    The SDK reads its own OTEL_* variables (sampler, batch sizes, exporter headers and
    timeouts) here, at construction: never at import.
    """
    if not config.is_enabled:
        return Tracing(None)
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: config.service_name}))
    if config.otlp_endpoint is not None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = config.otlp_endpoint
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
        provider.add_span_processor(BatchSpanProcessor(exporter))
    if config.is_console:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    _LOG.info(
        "tracing on: service.name %s, OTLP %s%s",
        config.service_name,
        config.otlp_endpoint or "off",
        ", console" if config.is_console else "",
    )
    return Tracing(provider)


def start_tracing(args: Any, service: str) -> Tracing:
    """For a service's `run`: its tracing config from its flags and the environment (read
    now, at start-up), installed. `service`: "frontend", "tokenizer", "prefill" or "decode"."""
    return setup_tracing(TracingConfig.from_args(args, os.environ, service))


def _is_traced_call(details: grpc.HandlerCallDetails) -> bool:
    """Server calls that get a span: not health/reflection, and neither a background Info
    poll nor a DetokenizeStream unless the caller sent trace context (without it each would
    start a new trace)."""
    method: str = details.method
    if method.startswith(_UNTRACED_PREFIXES):
        return False
    if method.endswith(_CONTEXT_ONLY_SUFFIXES):
        return any(key == _TRACEPARENT for key, _ in details.invocation_metadata or ())
    return True


# ---- client side ------------------------------------------------------------------------------


class _ClientSpans:
    """A CLIENT span per call, parented on the span current where the call was made, with its
    context injected as `traceparent`; the span ends when the call does.

    Ours rather than opentelemetry-instrumentation-grpc's aio client interceptors: those await
    a stream-unary call's status inside the interceptor (a deadlock for a call written with
    `call.write`, as the KV transfer is) and turn a unary-stream call into an iterator without
    `read()`. These return grpc's own call object for every kind.

    Calls made with no span current (background polls) are left untraced.
    """

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def _begin(
        self, details: grpc.aio.ClientCallDetails
    ) -> tuple[Span | None, grpc.aio.ClientCallDetails]:
        if not trace.get_current_span().get_span_context().is_valid:
            return None, details
        method = details.method
        if isinstance(method, bytes):  # grpc passes bytes here (grpc/grpc#31092)
            method = method.decode()
        service, _, name = method.lstrip("/").partition("/")
        span = self._tracer.start_span(
            method.lstrip("/"),
            kind=SpanKind.CLIENT,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        )
        metadata = grpc.aio.Metadata(*tuple(details.metadata or ()))
        propagate.inject(metadata, trace.set_span_in_context(span), setter=_Setter())
        return span, grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )

    async def _intercept(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        span, details = self._begin(details)
        if span is None:
            return await continuation(details, request)
        try:
            call = await continuation(details, request)
        except BaseException as exc:
            _end_span(span, grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}")
            raise
        call.add_done_callback(lambda done: _end_when_done(span, done))
        return call


# grpc.aio files an interceptor under the first call kind it subclasses, so one class per kind.
class _UnaryUnary(_ClientSpans, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await self._intercept(continuation, client_call_details, request)


class _UnaryStream(_ClientSpans, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await self._intercept(continuation, client_call_details, request)


class _StreamUnary(_ClientSpans, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await self._intercept(continuation, client_call_details, request_iterator)


def client_interceptors(tracer: trace.Tracer) -> list[grpc.aio.ClientInterceptor]:
    """One tracing interceptor per call kind we trace.

    No stream-stream interceptor: our only bidi call is decode's GenerateStream, whose requests
    carry their own trace context in their starts, and grpc.aio routes every message of an
    intercepted bidi call through an extra queue and task (a measurable share of the
    frontend's busy time: docs/benchmarks.md, "Tracing overhead").
    """
    return [_UnaryUnary(tracer), _UnaryStream(tracer), _StreamUnary(tracer)]


class _Setter(Setter[grpc.aio.Metadata]):
    def set(self, carrier: grpc.aio.Metadata, key: str, value: str) -> None:
        carrier[key] = value


def _end_when_done(span: Span, call: Any) -> None:
    """Done-callbacks cannot await the call's status; a task reads it (it is already in)."""

    async def end() -> None:
        try:
            code, details = await call.code(), await call.details()
        except Exception:  # cancelled before any status: say so rather than lose the span
            code, details = grpc.StatusCode.CANCELLED, "cancelled"
        _end_span(span, code, details)

    try:
        asyncio.get_running_loop().create_task(end())
    except RuntimeError:  # no loop (shutting down): end it without the status
        span.end()


def _end_span(span: Span, code: grpc.StatusCode, details: str | None) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}"))
    span.end()


# ---- helpers for services ---------------------------------------------------------------------


def current_span_context() -> SpanContext | None:
    """The current span's context when it is recorded (to link to later), else None: with
    tracing off nothing is kept, so batch loops skip their span work entirely."""
    span = trace.get_current_span()
    return span.get_span_context() if span.is_recording() else None


def start_batch_span(
    tracer: trace.Tracer,
    name: str,
    contexts: Sequence[SpanContext],
    attributes: Mapping[str, Any],
) -> Span:
    """A root span for work done for many requests at once, linked to each request's span."""
    return tracer.start_span(
        name,
        context=otel_context.Context(),  # a root: no request is "the" parent
        links=[Link(c) for c in contexts],
        attributes=dict(attributes),
    )


def trace_ids(span: Span | None = None) -> str:
    """`trace_id=... span_id=...` of `span` (default: the current one) for log lines; "" when
    there is none (tracing off)."""
    context = (span or trace.get_current_span()).get_span_context()
    if not context.is_valid:
        return ""
    return f" trace_id={context.trace_id:032x} span_id={context.span_id:016x}"


# ---- calls carried on a shared stream -----------------------------------------------------------


def start_carried_call_span(method: str) -> tuple[Span | None, dict[str, str]]:
    """A CLIENT span for one request carried on a stream shared with others (decode's
    GenerateStream), as `client_interceptors` makes for a call of its own, and the trace context
    to send with the request. (None, {}) when no recorded span is current (tracing off, or a
    background call)."""
    if not trace.get_current_span().is_recording():
        return None, {}
    service, _, name = method.lstrip("/").partition("/")
    span = trace.get_tracer("mili.rpc.client").start_span(
        method.lstrip("/"),
        kind=SpanKind.CLIENT,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
    )
    carrier: dict[str, str] = {}
    propagate.inject(carrier, trace.set_span_in_context(span))
    return span, carrier


def end_carried_call_span(span: Span, code: grpc.StatusCode, details: str | None = None) -> None:
    """End a `start_carried_call_span` span with the status its request ended with."""
    _end_span(span, code, details)
