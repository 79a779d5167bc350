"""gRPC edge of the decode service: DecodeService (Generate, GenerateStream, Info), and
registration of both services (KvTransferService lives in transfer.py) on one RpcServer.

Generate serves one request per call; GenerateStream many requests of one caller on one stream
(multiplex.py), each admitted the same way (admission.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import grpc
from opentelemetry import trace

from mili.discovery import Callers
from mili.errors import Cancelled, Unavailable
from mili.kv_handoff.codec import parse_transfer_request
from mili.pb.decode.v1 import decode_pb2, decode_pb2_grpc
from mili.pb.kv.v1 import kv_pb2
from mili.rpc.kv_layout import layout_to_proto
from mili.rpc.policy import (
    GENERATE_STREAM_BATCH_BYTES,
    REQUEST_FIELDS_BYTES,
    Policy,
    uint32s_bytes,
)
from mili.rpc.prefix_cache import prefix_cache_to_proto
from mili.rpc.server import RpcServer
from mili.telemetry.metrics import RequestMetrics
from services.decode import convert
from services.decode.admission import Admission, lease_expired
from services.decode.instance import DecodeInstance
from services.decode.multiplex import Multiplexer
from services.decode.requests import DecodeRequest, RequestState
from services.decode.stream import TokenEvent, TokenStream
from services.decode.transfer import KvTransferServicer

_TRACER = trace.get_tracer("mili.decode")  # a no-op until tracing installs a provider

DECODE_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
KV_TRANSFER_SERVICE = kv_pb2.DESCRIPTOR.services_by_name["KvTransferService"].full_name

# While a request waits for its KV, Generate wakes this often to notice a drain: a draining server
# refuses new TransferKv calls, so a request still WAITING then can never get its KV.
_WAIT_POLL_S = 0.25
_KV_PENDING = (RequestState.WAITING, RequestState.TRANSFERRING)


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(
        self,
        instance: DecodeInstance,
        *,
        is_draining: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
        request_metrics: RequestMetrics | None = None,
    ) -> None:
        self._instance = instance
        self._layout = layout_to_proto(instance.layout, instance.fingerprint)
        self._admission = Admission(instance, self._layout, clock=clock)
        self._is_draining = is_draining
        self._clock = clock
        # Calls counted by the server; requests on a GenerateStream are counted as Generate calls.
        self._request_metrics = request_metrics

    async def Generate(
        self, request: decode_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        inst = self._instance
        request_id = request.request_id
        req, outlet = await self._admission.admit(request)
        prompt = req.prompt_token_ids
        span = _TRACER.start_span(
            "decode request",
            attributes={
                "mili.request_id": request_id,
                "mili.client_request_id": request.client_request_id,
                "mili.decode.num_prompt_tokens": len(prompt),
                "mili.decode.num_blocks": len(req.block_table),
                # leading prompt blocks taken from the prefix cache (not sent by prefill)
                "mili.decode.num_cached_blocks": req.num_cached_blocks,
            },
        )
        is_traced = span.is_recording()
        if is_traced:  # batched steps link to this span
            outlet.span_context = span.get_span_context()
        num_tokens = 0
        try:
            yield convert.admitted(req)
            async for event in self._events(req, outlet.stream):
                if is_traced:
                    if not num_tokens:
                        span.add_event("first token")  # prefill's, once the KV landed
                    num_tokens += len(event.token_ids)
                    if event.finish_reason:
                        span.set_attribute("mili.decode.finish_reason", event.finish_reason)
                yield convert.tokens(event)
        finally:
            if is_traced:
                span.set_attribute("mili.decode.num_output_tokens", num_tokens)
            span.end()
            # Caller cancelled, deadline passed, or an error: free the blocks (a RUNNING request
            # leaves the batch within one step). A no-op when the request already ended.
            if inst.table.cancel(req):
                # Tells a transfer still streaming into its blocks to stop.
                outlet.stream.fail(Cancelled(f"request {req.name} was cancelled by its caller"))
            inst.outlets.release(request_id, outlet)

    async def _events(self, req: DecodeRequest, stream: TokenStream) -> AsyncIterator[TokenEvent]:
        """The request's token events until the last; raises its failure (lease, transfer...)."""
        table = self._instance.table
        while True:
            timeout_s = None
            if req.state in _KV_PENDING:
                if req.state is RequestState.WAITING and self._is_draining() and table.cancel(req):
                    stream.fail(Unavailable("decode instance is draining; retry elsewhere"))
                timeout_s = min(_WAIT_POLL_S, max(0.0, req.lease_deadline - self._clock()))
            try:
                event = await stream.next(timeout_s)
            except TimeoutError:
                if table.expire(req, self._clock()):
                    error = lease_expired(req)
                    stream.fail(error)  # a transfer still running reports the same error
                    raise error from None
                continue
            yield event
            if event.finish_reason:
                return

    async def GenerateStream(
        self,
        request_iterator: AsyncIterator[decode_pb2.GenerateStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[decode_pb2.GenerateStreamResponse]:
        multiplexer = Multiplexer(
            self._admission,
            self._instance.table,
            self._instance.outlets,
            metrics=self._request_metrics,
            is_draining=self._is_draining,
            clock=self._clock,
        )
        async with aclosing(multiplexer.run(request_iterator)) as responses:
            async for response in responses:
                yield response

    async def Info(
        self, request: decode_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.InfoResponse:
        inst = self._instance
        table = inst.table
        return decode_pb2.InfoResponse(
            model=inst.model_name,
            dtype=inst.dtype,
            device=inst.device,
            kv_layout=self._layout,
            attention_backend=inst.attention_backend,
            fused_ops=inst.fused_ops,
            architecture=inst.architecture,
            num_experts=inst.num_experts,
            num_active_experts=inst.num_active_experts,
            tokenizer_file_sha256=inst.tokenizer_file_sha256,
            max_context_tokens=inst.max_context_tokens,
            max_running=inst.config.max_running,
            num_total_blocks=table.num_total_blocks,
            num_free_blocks=table.num_free_blocks,
            num_running=table.num_running,
            num_waiting=table.num_waiting,
            kv_cache_bytes=inst.kv_cache_bytes,
            num_cuda_graphs=inst.num_cuda_graphs,
            prefix_cache=prefix_cache_to_proto(table.prefix_cache_reading()),
            kv_transports=inst.endpoint.transports,
        )


def add_to_server(
    server: RpcServer,
    instance: DecodeInstance,
    *,
    frontends: Callers | None = None,
    prefills: Callers | None = None,
) -> None:
    """Register DecodeService and KvTransferService (one address: prefill sends KV here).

    Who may call what (the server checks it before a servicer runs; default: this machine):
    `frontends` admit requests (Generate, GenerateStream: they reserve blocks), `prefills` pair
    and push KV (Pair, TransferKv). Info is open: a read of the instance's load and layout."""
    frontends = frontends or Callers("--frontend")
    prefills = prefills or Callers("--prefill")
    decode = DecodeServicer(
        instance, is_draining=lambda: server.is_draining, request_metrics=server.request_metrics
    )
    transfer = KvTransferServicer(
        instance,
        is_draining=lambda: server.is_draining,
        max_message_bytes=server.config.receive_limit,
    )
    # Largest requests: a prompt of the whole context (decode refuses longer ones anyway);
    # GenerateStream messages carry a frontend's starts up to GENERATE_STREAM_BATCH_BYTES
    # together, or one larger start alone; TransferKv's KV chunks are megabytes (the server's
    # limit, --max-message-bytes); Pair and Info hold a few fields.
    generate = uint32s_bytes(instance.max_context_tokens) + REQUEST_FIELDS_BYTES
    admission = Policy(
        max_request_bytes={
            "Generate": generate,
            "GenerateStream": max(generate, GENERATE_STREAM_BATCH_BYTES + REQUEST_FIELDS_BYTES),
        },
        callers={"Generate": frontends, "GenerateStream": frontends},
    )
    kv = Policy(
        max_request_bytes={"TransferKv": server.config.receive_limit},
        callers={"Pair": prefills, "TransferKv": prefills},
    )
    server.add_service(
        DECODE_SERVICE,
        lambda s: decode_pb2_grpc.add_DecodeServiceServicer_to_server(decode, s),
        admission,
    )
    server.add_service(KV_TRANSFER_SERVICE, lambda s: _add_transfer(transfer, s), kv)


def _add_transfer(transfer: KvTransferServicer, server: grpc.aio.Server) -> None:
    """kv_pb2_grpc.add_KvTransferServiceServicer_to_server, but with a request deserializer
    that leaves each chunk's bytes in place (codec.parse_transfer_request)."""
    handlers = {
        "TransferKv": grpc.stream_unary_rpc_method_handler(
            transfer.TransferKv,
            request_deserializer=parse_transfer_request,
            response_serializer=kv_pb2.TransferKvResponse.SerializeToString,
        ),
        "Pair": grpc.unary_unary_rpc_method_handler(
            transfer.Pair,
            request_deserializer=kv_pb2.PairRequest.FromString,
            response_serializer=kv_pb2.PairResponse.SerializeToString,
        ),
    }
    _register(server, KV_TRANSFER_SERVICE, handlers)


def _register(
    server: grpc.aio.Server, service: str, handlers: dict[str, grpc.RpcMethodHandler]
) -> None:
    """What a generated add_*Servicer_to_server does with its handlers."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
