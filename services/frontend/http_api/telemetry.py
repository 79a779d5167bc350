"""Operations for every request on the HTTP port: its trace, its metrics, its id, its 5xx line.

    request ──▶ telemetry middleware (outermost: it sees the status openai_errors chose)
                  id      X-Request-Id as the caller sent it, else a fresh one (request_id_of);
                          echoed on every response, streams and errors included
                  span    SERVER `{METHOD} {route}`, child of the caller's `traceparent` (the
                          global propagator, as gRPC's), current while the handler runs: a
                          generation's `generate {model}` span and its gRPC calls are its
                          children. Ends with the response's last byte (a stream's end).
                  metrics mili_http_requests_total{route, method, status} and
                          mili_http_request_duration_seconds{route}, once per request
                  log     a 5xx: one WARNING line (method, path, status, id, trace ids). Any
                          other request logs nothing here: a generation's one line is its
                          RequestObserver's, and /v1/models, 404s and 400s before a generation
                          starts are counted, not logged.

Labels stay bounded whatever clients send: `route` is the matched route's template
(`/status/{request_id}`, never the raw path; `unmatched` when no route took the path and
method), `method` one of HTTP's (`_OTHER` for the rest, as OpenTelemetry's conventions say),
`status` the code sent, or 499 (nginx's "client closed request") when the client went away
before a status was sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from mili.errors import InvalidArgument
from mili.telemetry.metrics import FrontendMetrics
from mili.telemetry.tracing import trace_ids

REQUEST_ID_HEADER = "X-Request-Id"
UNMATCHED = "unmatched"
CLIENT_CLOSED = 499  # the client went away before a status was sent (nginx's code)
_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"}
)
_REQUEST_ID = web.RequestKey("mili_request_id", str)
_SENT_STATUS = web.RequestKey("mili_sent_status", int)  # set as the response's headers go out
# A stream that failed after its headers went out: the status its error carries.
_STREAM_FAILED = web.RequestKey("mili_stream_failed", int)
_LOG = logging.getLogger("mili.frontend")
# The global provider's tracer: a no-op until mili.telemetry.tracing installs one.
_TRACER = trace.get_tracer("mili.frontend.http")


def request_id_of(request: web.Request) -> str:
    """The request's id, the same every time it is asked: the caller's `X-Request-Id`, or a
    fresh one (a uuid4 in hex, as the gRPC API makes) when it sent none. Every response
    echoes it in `X-Request-Id`; the generation routes pass it on as the client request id
    (RequestInput.client_request_id), so the generation's log line, its span
    (gen_ai.response.id) and the OpenAI response's `id` can name it. Its length is the
    generation's to check (one rule: over 256 characters is a 400 naming `request_id`)."""
    request_id = request.get(_REQUEST_ID)
    if request_id is None:
        given = request.headers.get(REQUEST_ID_HEADER)
        request_id = given if given and is_header_safe(given) else uuid.uuid4().hex
        request[_REQUEST_ID] = request_id
    return request_id


def is_header_safe(request_id: str) -> bool:
    """Printable ASCII: what an id must be to be echoed in X-Request-Id (a header's other bytes,
    which aiohttp hands in as surrogates, would also fail the gRPC string it is passed on in;
    a line break would break the response's headers)."""
    return request_id.isascii() and request_id.isprintable()


def set_request_id(request: web.Request, request_id: str) -> None:
    """The request's id is `request_id` (a route that reads it from the body), before its
    response's headers go out; InvalidArgument naming `request_id` when it cannot be echoed."""
    if not is_header_safe(request_id):
        raise InvalidArgument(
            "request_id", request_id[:64], "must be printable ASCII (X-Request-Id echoes it)"
        )
    request[_REQUEST_ID] = request_id


def stream_failed(request: web.Request, status: int) -> None:
    """The request's stream ended in an error event (its headers, 200, went out before): the
    series count it under `status`, and its span is an error, as a failure before the headers
    would be (an HTTP error rate that misses every stream a decode dying cut off is none)."""
    request[_STREAM_FAILED] = status


def add_telemetry(
    app: web.Application, metrics: FrontendMetrics, tracer: trace.Tracer = _TRACER
) -> None:
    """Trace, count, identify and (5xx) log every request `app` answers; call once, before
    the app starts. The middleware goes first, outside every other one. `tracer`: the global
    provider's (tests pass their own provider's)."""
    app.middlewares.insert(0, telemetry_middleware(metrics, tracer))
    app.on_response_prepare.append(_on_response_prepare)


async def _on_response_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every response, as its headers go out (a stream's before its first chunk)."""
    response.headers[REQUEST_ID_HEADER] = request_id_of(request)
    request[_SENT_STATUS] = response.status


def route_of(request: web.Request) -> str:
    """The matched route's template (bounded cardinality), or UNMATCHED."""
    resource = request.match_info.route.resource
    return UNMATCHED if resource is None else resource.canonical


def telemetry_middleware(metrics: FrontendMetrics, tracer: trace.Tracer = _TRACER) -> Middleware:
    """The middleware `add_telemetry` installs."""

    @web.middleware
    async def telemetry(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.monotonic()
        route = route_of(request)
        method = request.method if request.method in _METHODS else "_OTHER"
        # OpenTelemetry's HTTP conventions: `{method} {route}`, the method alone without a
        # route, `HTTP` for a method of no standard.
        name = "HTTP" if method == "_OTHER" else method
        span = tracer.start_span(
            name if route == UNMATCHED else f"{name} {route}",
            context=propagate.extract(request.headers),
            kind=SpanKind.SERVER,
            attributes=_request_attributes(request, method, route),
        )
        status: int | None = None
        try:
            with trace.use_span(span, record_exception=False, set_status_on_exception=False):
                response = await handler(request)
                status = response.status
                if not response.prepared and _SENT_STATUS in request:
                    _cut_short(request, response.status)
                elif not response.prepared:
                    # Send it here, so the span and the duration cover its body too (a
                    # stream's handler sent it all already).
                    try:
                        await response.prepare(request)
                        await response.write_eof()
                    except ConnectionError:
                        pass  # the client went away; aiohttp sees it again and gives up
            return response
        except web.HTTPException as exc:  # a redirect or the like, sent by aiohttp
            status = exc.status
            raise
        except asyncio.CancelledError:
            span.set_attribute("error.type", "cancelled")
            raise
        finally:
            # What went out on the wire wins: a stream whose handler failed after its headers
            # went out was answered with them.
            status = request.get(_SENT_STATUS, status)
            _finish(request, span, metrics, route, method, status, time.monotonic() - started)

    return telemetry


def _cut_short(request: web.Request, status: int) -> None:
    """A stream failed after its headers went out, and an error response (openai_errors')
    came back in its place: it cannot follow them on the wire (it would land inside the
    stream's body), so the connection is closed instead and the client sees the stream cut
    short. Counted as stream_failed says."""
    stream_failed(request, status)
    if request.transport is not None:
        request.transport.close()


def _request_attributes(request: web.Request, method: str, route: str) -> dict[str, str | int]:
    url = request.url
    attributes: dict[str, str | int] = {
        "http.request.method": method,
        "url.path": request.path,
        "url.scheme": request.scheme,
        "network.protocol.version": f"{request.version.major}.{request.version.minor}",
    }
    if method == "_OTHER":
        attributes["http.request.method_original"] = request.method
    if route != UNMATCHED:
        attributes["http.route"] = route
    if url.host:
        attributes["server.address"] = url.host
    if url.port is not None:
        attributes["server.port"] = url.port
    if request.remote:
        attributes["client.address"] = request.remote
    user_agent = request.headers.get("User-Agent")
    if user_agent:
        attributes["user_agent.original"] = user_agent
    return attributes


def _finish(
    request: web.Request,
    span: Span,
    metrics: FrontendMetrics,
    route: str,
    method: str,
    status: int | None,
    elapsed_s: float,
) -> None:
    code = CLIENT_CLOSED if status is None else status
    failed = request.get(_STREAM_FAILED)
    if failed is not None:  # the wire said `status`, the stream's end said `failed`
        code = failed
    metrics.http_requests.labels(route, method, str(code)).inc()
    metrics.http_request_duration.labels(route).observe(elapsed_s)
    if status is not None:
        span.set_attribute("http.response.status_code", status)
    if code >= 500:
        # A server span's error is a 5xx; a 4xx is the client's (OpenTelemetry's conventions).
        span.set_attribute("error.type", str(code))
        late = None if failed is None else "failed after the response started"
        span.set_status(Status(StatusCode.ERROR, late))
        _LOG.warning(
            "HTTP %s %s -> %d (X-Request-Id %r) after %.1f ms%s",
            request.method,
            request.rel_url.raw_path[:256],
            code,
            request_id_of(request),
            elapsed_s * 1e3,
            trace_ids(span),
        )
    span.end()
