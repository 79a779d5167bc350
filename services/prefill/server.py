"""gRPC edge of the prefill service: PrefillRequest -> PrefillTask -> worker + KV sender -> reply.

Life of one Prefill call (all awaits; the model runs only in the worker thread):

    validate ─▶ queue bound (RESOURCE_EXHAUSTED when full)
             ─▶ KvSender.run: header, then worker.submit, chunks as layers complete, commit,
                decode's ack
             ─▶ finally worker.remove: the prompt's blocks are freed on every path
                (ack, decode's error, compute error, caller cancelled or deadline passed)
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span

from mili.discovery import Callers, PeerSet, Resolve, resolve_host
from mili.engine.kv.block_pool import blocks_needed
from mili.errors import PermissionDenied, Unavailable
from mili.kv_handoff.kv_transport import TransportConfig
from mili.pb.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from mili.rpc.kv_layout import block_bytes, layout_to_proto
from mili.rpc.policy import REQUEST_FIELDS_BYTES, Policy, uint32s_bytes
from mili.rpc.prefix_cache import prefix_cache_to_proto
from mili.rpc.server import RpcServer
from mili.rpc.tls import Tls
from mili.telemetry.metrics import PrefillMetrics
from mili.telemetry.tracing import current_span_context
from services.prefill import convert
from services.prefill.config import PrefillConfig
from services.prefill.instance import PrefillInstance
from services.prefill.pairing import Peers
from services.prefill.scheduler import Scheduler
from services.prefill.sender import KvSender, TransferResult, logprobs
from services.prefill.task import FirstToken
from services.prefill.worker import PrefillWorker

_TRACER = trace.get_tracer("mili.prefill")  # a no-op until tracing installs a provider

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    """The gRPC edge over a PrefillInstance (which owns the model, the KV pool and the worker);
    owns the decode channels and the KV encoder threads."""

    def __init__(
        self,
        instance: PrefillInstance,
        *,
        max_message_bytes: int,
        num_encoder_threads: int = 2,
        client_interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        tls: Tls | None = None,
        resolve: Resolve = resolve_host,
    ) -> None:
        """`tls`: KV goes to decode over TLS with these certificates. `resolve`: the lookup of
        dns:/// entries in --decode (tests pass their own)."""
        self.instance = instance
        self.config: PrefillConfig = instance.config
        # Decode instances allowed by DNS name: an address is looked up when not known yet.
        self._decode_names = PeerSet(self.config.decode_names, resolve=resolve)
        self.layout = layout_to_proto(instance.layout, instance.fingerprint)
        self.max_prompt_tokens = instance.max_prompt_tokens
        # One message carries one layer of one chunk: it must fit the gRPC message limit.
        chunk_blocks = self.scheduler.chunk_tokens // self.config.engine.block_size
        largest = 2 * block_bytes(self.layout) * chunk_blocks
        if largest + 4096 > max_message_bytes:
            raise ValueError(
                f"a KV chunk of max_batch_tokens {self.config.max_batch_tokens} is {largest} "
                f"bytes, more than max_message_bytes {max_message_bytes}; lower "
                "--max-batch-tokens"
            )
        names = self._decode_names

        def server_name(address: str) -> str | None:
            target = names.target_of(address)
            return None if target is None else target.host

        transport = TransportConfig(self.config.kv_transport, self.config.host_id)
        model = instance.runner.model
        self.peers = Peers(
            max_message_bytes,
            endpoint=transport.endpoint(str(model.device)),
            layout=self.layout,
            dtype=model.dtype,
            interceptors=client_interceptors,
            tls=tls,
            server_name=server_name,
        )
        self._encoder = ThreadPoolExecutor(num_encoder_threads, thread_name_prefix="kv-encode")
        self._num_encoder_threads = num_encoder_threads
        instance.start()

    @property
    def worker(self) -> PrefillWorker:
        return self.instance.worker

    @property
    def scheduler(self) -> Scheduler:
        return self.instance.scheduler

    @property
    def metrics(self) -> PrefillMetrics:
        return self.instance.metrics

    async def close(self) -> None:
        """Stop the worker (failing what is left), close channels and the encoder threads."""
        await asyncio.to_thread(self.instance.stop)
        await self.peers.close()
        self._encoder.shutdown(wait=False, cancel_futures=True)

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        task = convert.prefill_task(
            request,
            vocab_size=self.instance.model.config.vocab_size,
            max_prompt_tokens=self.max_prompt_tokens,
            block_size=self.config.engine.block_size,
        )
        if not self.config.may_send_to(task.address) and not (
            self.config.decode_names and await self._decode_names.has_address(task.address)
        ):
            # Checked before any channel exists: a caller cannot make us dial anything else.
            raise PermissionDenied(
                f"destination.address {task.address!r} is not a decode instance this prefill "
                "instance may send KV to (its --decode list)"
            )
        span_context = current_span_context()  # None when tracing is off
        if span_context is not None:
            task = dataclasses.replace(task, span_context=span_context)
        timeout_s = self.config.transfer_timeout_s
        remaining = context.time_remaining()
        if remaining is not None:  # end the transfer with the caller's deadline
            timeout_s = min(timeout_s, max(remaining, 0.001))
        num_chunks = self.scheduler.num_shipped_chunks(
            len(task.prompt_token_ids), task.num_cached_blocks
        )
        pairing = await self.peers.pair(task.address)
        sender = KvSender(
            task,
            channel=self.peers.get(task.address),
            encoder=self._encoder,
            layout=self.layout,
            num_chunks=self.layout.num_layers * num_chunks,
            timeout_s=timeout_s,
            pairing=pairing,
            encoder_threads=self._num_encoder_threads,
        )
        # Refuse a full queue (or a request id already here) before opening a stream to
        # decode; `submit` checks again.
        self.worker.check_capacity(task)
        is_submitted = False
        submitted_ns = 0

        def submit() -> None:
            nonlocal is_submitted, submitted_ns
            submitted_ns = time.time_ns()
            self.worker.submit(task, sender)
            is_submitted = True

        try:
            # The stream to decode runs inside this span, so decode's TransferKv joins the
            # trace under it; it overlaps the compute (layer i ships while i+1 runs).
            with _TRACER.start_as_current_span(
                "kv transfer", attributes={"mili.kv.destination": task.address}
            ) as span:
                try:
                    result = await sender.run(submit)
                except Unavailable:
                    self.peers.forget(task.address)  # decode gone: pair again next time
                    raise
                _record_transfer(
                    span,
                    result,
                    len(task.prompt_block_ids) - task.num_cached_blocks,
                    self.layout.num_layers,
                )
        finally:
            if is_submitted:  # never remove another call's prompt that has the same id
                self.worker.remove(task.request_id)
        _record_compute(len(task.prompt_token_ids), result.first, submitted_ns)
        self.metrics.record_transfer(result.kv_bytes, result.transfer_ms / 1e3)
        first = result.first
        return prefill_pb2.PrefillResponse(
            first_token_id=first.token_id,
            first_logprobs=logprobs(first),
            num_prompt_tokens=len(task.prompt_token_ids),
            queue_ms=first.queue_ms,
            compute_ms=first.compute_ms,
            transfer_ms=result.transfer_ms,
            kv_bytes=result.kv_bytes,
            num_cached_tokens=first.num_cached_tokens,
        )

    async def Info(
        self, request: prefill_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.InfoResponse:
        instance = self.instance
        return prefill_pb2.InfoResponse(
            model=instance.model_name,
            dtype=instance.dtype,
            device=instance.device,
            kv_layout=self.layout,
            attention_backend=instance.attention_backend,
            fused_ops=instance.fused_ops,
            max_prompt_tokens=self.max_prompt_tokens,
            max_batch_tokens=self.config.max_batch_tokens,
            num_queued_tokens=self.worker.num_queued_tokens,
            num_total_blocks=self.worker.num_total_blocks,
            num_free_blocks=self.worker.num_free_blocks,
            kv_cache_bytes=instance.runner.kv_cache_bytes,
            prefix_cache=prefix_cache_to_proto(instance.worker.prefix_cache_reading()),
            kv_transports=self.peers.transports(),
        )


def _record_transfer(span: Span, result: TransferResult, num_blocks: int, num_layers: int) -> None:
    if not span.is_recording():
        return
    seconds = result.transfer_ms / 1e3
    span.set_attributes(
        {
            "mili.kv.bytes": result.kv_bytes,
            "mili.kv.num_blocks": num_blocks,  # prompt blocks, each sent once per layer
            "mili.kv.num_layers": num_layers,
            "mili.kv.transfer_ms": result.transfer_ms,
            "mili.kv.gb_per_s": result.kv_bytes / seconds / 1e9 if seconds > 0 else 0.0,
        }
    )


def _record_compute(num_prompt_tokens: int, first: FirstToken, submitted_ns: int) -> None:
    """The prompt's compute as a span, from the worker's timings (the worker thread runs it
    batched with others; `prefill step` spans link back to this request)."""
    if not trace.get_current_span().is_recording():
        return
    start_ns = submitted_ns + int(first.queue_ms * 1e6)
    span = _TRACER.start_span(
        "prefill compute",
        start_time=start_ns,
        attributes={
            "mili.prefill.num_prompt_tokens": num_prompt_tokens,
            "mili.prefill.batch_size": first.batch_size,
            "mili.prefill.queue_ms": first.queue_ms,
            "mili.prefill.compute_ms": first.compute_ms,
            # prompt tokens taken from the prefix cache instead of computed
            "mili.prefill.num_cached_tokens": first.num_cached_tokens,
        },
    )
    span.end(end_time=start_ns + int(first.compute_ms * 1e6))


def add_to_server(
    server: RpcServer, servicer: PrefillServicer, *, frontends: Callers | None = None
) -> None:
    """Register PrefillService. Prefill takes calls only from `frontends` (checked by the server
    before the servicer runs; default: this machine) and requests up to a prompt of
    max_prompt_tokens with its block ids; Info is open."""
    frontends = frontends or Callers("--frontend")
    num_blocks = blocks_needed(servicer.max_prompt_tokens, servicer.config.engine.block_size)
    prefill = uint32s_bytes(servicer.max_prompt_tokens) + uint32s_bytes(num_blocks)
    policy = Policy(
        max_request_bytes={"Prefill": prefill + REQUEST_FIELDS_BYTES},
        callers={"Prefill": frontends},
    )
    server.add_service(
        SERVICE_NAME,
        lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, s),
        policy,
    )
