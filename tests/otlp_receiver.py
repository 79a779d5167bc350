"""A real OTLP/gRPC trace receiver for tests: every span exported to it, with the service that
sent it, from any process (`mili serve --otlp-endpoint http://127.0.0.1:PORT`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector keeping every span with its resource's service.name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, trace_pb2.Span]] = []
        self._lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[tuple[str, trace_pb2.Span]]:
        with self._lock:
            return list(self.spans)


@contextlib.contextmanager
def serving() -> Iterator[tuple[Receiver, int]]:
    """A Receiver on a free port of 127.0.0.1 (and the port), until the block ends."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    receiver = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, port
    finally:
        server.stop(0)
