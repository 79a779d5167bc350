"""One prompt's prefill and KV hand-off to the decode instance that reserved its blocks (what
the Prefill handler runs between its two conversions), all awaits: the model runs only in the
worker thread.

    destination allowed? (PERMISSION_DENIED before any channel exists) ─▶ pair (pairing.py)
    ─▶ queue room reserved (RESOURCE_EXHAUSTED, before decode hears of the prompt) ─▶
    KvSender.run: header, then worker.submit (into the reserved room: no refusal for room after
    the header), chunks as layers complete, commit, decode's ack ─▶ finally worker.remove: the
    room and the prompt's blocks are freed on every path (ack, decode's error, compute error,
    caller cancelled or deadline passed)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span

from mili.discovery import PeerSet, Resolve, resolve_host
from mili.engine.constraint.compiler import compile_for
from mili.errors import PermissionDenied, Unavailable
from mili.kv_handoff.kv_transport import TransportConfig
from mili.rpc.kv_layout import block_bytes, layout_to_proto
from mili.rpc.tls import Tls
from mili.telemetry.tracing import current_span_context
from services.prefill.instance import PrefillInstance
from services.prefill.pairing import Peers
from services.prefill.sender import KvSender, TransferResult
from services.prefill.task import FirstToken, PrefillTask

_TRACER = trace.get_tracer("mili.prefill")  # a no-op until tracing installs a provider
_ENCODER_THREADS = 2  # copy and checksum the KV chunks bound for decode, shared by all prompts


class KvHandoff:
    """A prefill instance's way to decode: the decode instances it may send KV to, one channel
    and pair per address, the KV encoder threads; `prefill` runs one prompt through them."""

    def __init__(
        self,
        instance: PrefillInstance,
        max_message_bytes: int,
        client_interceptors: Sequence[grpc.aio.ClientInterceptor],
        tls: Tls | None,
        *,
        resolve: Resolve = resolve_host,
    ) -> None:
        """`resolve`: the lookup of dns:/// entries in --decode (tests may pass their own)."""
        self.instance = instance
        config = instance.config
        # The decodes we may send to: a DNS name's addresses are looked up when not known yet.
        self._decodes = decodes = PeerSet.parse(config.allowed_decodes, resolve=resolve)
        self.layout = layout_to_proto(instance.layout, instance.fingerprint)
        # One message carries one layer of one chunk: it must fit the gRPC message limit.
        chunk_blocks = instance.scheduler.chunk_tokens // config.engine.block_size
        largest = 2 * block_bytes(self.layout) * chunk_blocks + 4096  # the chunk's other fields
        if largest > max_message_bytes:
            raise ValueError(
                f"a KV chunk of max_batch_tokens {config.max_batch_tokens} is {largest} "
                f"bytes, more than max_message_bytes {max_message_bytes}; lower "
                "--max-batch-tokens"
            )

        def server_name(address: str) -> str | None:
            target = decodes.target_of(address)
            return None if target is None else target.host

        transport = TransportConfig(config.kv_transport, config.host_id)
        model = instance.runner.model
        self.peers = Peers(
            max_message_bytes,
            largest_message_bytes=largest,
            endpoint=transport.endpoint(str(model.device)),
            layout=self.layout,
            dtype=model.dtype,
            interceptors=client_interceptors,
            tls=tls,
            server_name=server_name,
        )
        self._encoder = ThreadPoolExecutor(_ENCODER_THREADS, thread_name_prefix="kv-encode")

    async def close(self) -> None:
        await self.peers.close()
        self._encoder.shutdown(wait=False, cancel_futures=True)

    async def prefill(self, task: PrefillTask, time_remaining_s: float | None) -> TransferResult:
        """Compute `task`'s prompt and stream its KV to its destination, within the caller's
        `time_remaining_s` (None: no deadline) and --transfer-timeout; decode's ack, or the
        domain error (mili.errors) of whatever failed."""
        if not await self._decodes.has_address(task.address):
            # Checked before any channel exists: a caller cannot make us dial anything else.
            raise PermissionDenied(
                f"destination.address {task.address!r} is not a decode instance this prefill "
                "instance may send KV to (its --decode list)"
            )
        span_context = current_span_context()  # None when tracing is off
        if span_context is not None:
            task = dataclasses.replace(task, span_context=span_context)
        # Compiled off the event loop and the worker thread (a cache hit after the first
        # request with it), before any queue room or block is held.
        compiled = await compile_for(self.instance.constraints, task.sampling.constraint)
        if compiled is not None:
            task = dataclasses.replace(task, constraint=compiled)
        timeout_s = self.instance.config.transfer_timeout_s
        if time_remaining_s is not None:  # end the transfer with the caller's deadline
            timeout_s = min(timeout_s, max(time_remaining_s, 0.001))
        num_chunks = self.instance.scheduler.num_shipped_chunks(
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
            encoder_threads=_ENCODER_THREADS,
        )
        worker = self.instance.worker
        # Hold the prompt's queue room before the header goes out to decode (RESOURCE_EXHAUSTED
        # for a full queue, with no stream opened): once decode has the header, `submit`
        # cannot refuse the prompt for room. The reservation is ours from here (a request id
        # already here is refused): `remove` gives it, or the prompt's blocks, back.
        worker.reserve(task)
        submitted_ns = 0

        def submit() -> None:
            nonlocal submitted_ns
            submitted_ns = time.time_ns()
            worker.submit(task, sender)

        try:
            # The stream to decode runs inside this span, so decode's TransferKv joins the
            # trace under it; it overlaps the compute (layer i ships while i+1 runs).
            with _TRACER.start_as_current_span(
                "kv transfer", attributes={"mili.kv.destination": task.address}
            ) as span:
                try:
                    result = await sender.run(submit, lambda: worker.remove(task.request_id))
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
            worker.remove(task.request_id)
        _record_compute(len(task.prompt_token_ids), result.first, submitted_ns)
        self.instance.metrics.record_transfer(result.kv_bytes, result.transfer_ms / 1e3)
        return result


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
