"""gRPC edge of KV transfer: prefill streams a request's prompt KV into its reserved blocks.

    header  request_id of at most MAX_REQUEST_ID_CHARS, request must be WAITING
            (-> TRANSFERRING), layouts equal (convert.py), num_tokens =
            prompt length, a paired transport, a known checksum (progress.py);
            in-place transports (shm, cuda-ipc): the blocks are held for the call (and a grace
            after a failed one), then the sender is told it may write (codec.ACCEPTED_KEY)
    chunk*  seq 0, 1, 2, ... ; request id matches ; blocks within the prompt's reservation
            (checked on the event loop, in order) ; then landed by the pair's transport on a
            landing thread (mili.kv_handoff: grpc checks CRC and length and scatters the bytes
            into the cache; in place, what the blocks hold is checked), the request pinned
            meanwhile
    commit  once every chunk has landed: every (layer, prompt block) written exactly once,
            chunk count = header.num_chunks; then the request joins the batch with prefill's
            first token. In place it may come inside the last chunk batch (KvChunks.commit):
            one message fewer each way

Receiving, checking and scattering overlap: the event loop reads chunk i+1 (and the sender
keeps streaming) while chunk i is checked and copied on a landing thread (zlib.crc32 and the
copy release the GIL). At most _MAX_LANDING_BYTES of one transfer's chunks wait to land; past
that the loop stops reading, and HTTP/2 flow control holds the sender back. In place (shm,
cuda-ipc) a landing only checks blocks already in the pool and holds no bytes; a batch of such
chunks is split among the landing threads where the checks run on the host (shm: the CPU's
checksums release the GIL), and stays one job where they run on the device (cuda-ipc: a pass
of launches and one read back for the whole batch, where each share would pay its own).

    event loop   read ─ check order ─ pin ─ submit ─▶ read ─ ...      commit: wait for all
    landing                           └─▶ CRC, length, scatter, unpin

A chunk is read in place (codec.parse_transfer_request is the method's deserializer, see
server.py): its data stays in the bytes grpc delivered, and the scatter is the one copy of it.

Any failure after the header fails the request too: its Generate stream ends with the same
status and its blocks are freed. A sender that gives up on purpose says so (an `abort` message
in place of the commit): the request fails with the sender's status (CANCELLED, DEADLINE_EXCEEDED,
RESOURCE_EXHAUSTED; anything else is UNAVAILABLE blaming the sender). A stream that breaks off
without one is a sender that died: UNAVAILABLE blaming the sender (ErrorInfo PEER_UNAVAILABLE),
so the frontend does not take this healthy instance out of routing for it; past the call's
deadline it is DEADLINE_EXCEEDED, and while this instance drains, its own UNAVAILABLE. A chunk
that fails on a landing thread is seen at once, also while the loop waits for the next message.
Blocks are freed only after the last landing into them is over (pins, see requests.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from opentelemetry import trace

from mili.arith import ceil_div
from mili.errors import (
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    InvalidArgument,
    MiliError,
    PeerUnavailable,
    ResourceExhausted,
    Unavailable,
)
from mili.kv_handoff.codec import ACCEPTED_KEY, Chunk, ChunkView
from mili.kv_handoff.transport import answer, receivers
from mili.pb.kv.v1 import kv_pb2, kv_pb2_grpc
from mili.plural import plural
from mili.rpc import heap
from mili.rpc.kv_layout import block_bytes, layout_to_proto
from mili.rpc.policy import MAX_REQUEST_ID_CHARS
from mili.rpc.sampling import logprobs_from_proto
from services.decode import convert
from services.decode.instance import DecodeInstance
from services.decode.landing import Landing, Reader
from services.decode.progress import TransferProgress
from services.decode.requests import DecodeRequest, RequestState
from services.decode.stream import Outlets

# What TransferKv reads: chunks arrive as ChunkViews (mili.kv_handoff.codec's
# parse_transfer_request is the method's request deserializer, see server.py), the rest as
# protobuf messages.
Message = kv_pb2.TransferKvRequest | ChunkView

_LOG = logging.getLogger("mili.decode")
_CANCEL_GRACE_S = 0.1
# Payload of one transfer's chunks received but not landed yet (always at least one chunk):
# bounds the memory a transfer holds beyond the cache itself. Two or more chunks keep both
# landing threads busy; larger bounds bought nothing (docs/benchmarks.md, "Measurements behind
# choices in the code").
_MAX_LANDING_BYTES = 16 << 20
_LANDING_THREADS = 2  # shared by all transfers: two chunks are checked and copied at a time
# How long the blocks of an in-place (shm, cuda-ipc) transfer whose sender did not close its
# side (a commit or an abort, each sent once its copies are over) stay held: a sender's copy
# of one chunk already under way when the call ended (a few ms; a layer of a chunk is at most
# --max-batch-tokens tokens of one layer's K and V) must land before the blocks can go to
# another request.
_IN_PLACE_GRACE_S = 2.0
# How long a failed in-place transfer waits for its sender to close the stream before ending
# the call itself: a sender about to commit gets the request's status cleanly; one still
# computing (or hung) would otherwise hold the blocks until it is done, past the request's
# end. Once the call ends the sender writes no further chunk (_IN_PLACE_GRACE_S then covers
# the one under way).
_IN_PLACE_DRAIN_S = 2.0


_GRPC_CODES = {code.value[0]: code for code in grpc.StatusCode}
# A sender's abort (TransferAbort) that the request fails with as it is: a status its caller
# can act on. Any other code (the prefill instance stopping, its compute failing) means the
# sender could not go on: UNAVAILABLE blaming it, never this instance.
_ABORTS: dict[grpc.StatusCode, Callable[[str], MiliError]] = {
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
}


def _aborted(request: DecodeRequest, abort: kv_pb2.TransferAbort, peer: str) -> MiliError:
    """The error a sender's abort fails the request with (`peer`: the sender, as grpc names
    it)."""
    code = _GRPC_CODES.get(abort.code, grpc.StatusCode.UNKNOWN)
    what = (
        f"the prefill instance at {peer} gave up the KV transfer of request {request.name}: "
        f"{code.name}: {abort.message}"
    )
    error = _ABORTS.get(code)
    return PeerUnavailable(what, peer=peer) if error is None else error(what)


def _broke_off(request: DecodeRequest, peer: str, *, is_draining: bool, is_late: bool) -> MiliError:
    """Why a transfer whose call ended without a commit or an abort failed (the call was
    cancelled under the handler): this instance is stopping, the call's deadline passed, or
    else the sender went away (its process died, or its connection did)."""
    if is_draining:
        return Unavailable(
            f"the KV transfer of request {request.name} ended: this decode instance is "
            "stopping; retry the request"
        )
    if is_late:
        return DeadlineExceeded(f"the KV transfer of request {request.name} ran past its deadline")
    return PeerUnavailable(
        f"the KV transfer of request {request.name} broke off mid-way (the prefill instance at "
        f"{peer} went away, or its connection did); retry the request",
        peer=peer,
    )


def _annotate_span(progress: TransferProgress) -> None:
    """What landed, on the TransferKv server span (a child of prefill's `kv transfer`)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(
            {
                "mili.request_id": progress.request.request_id,
                "mili.kv.bytes": progress.num_bytes,
                "mili.kv.num_chunks": progress.num_chunks,
                "mili.kv.num_blocks": len(progress.request.received_block_ids),
            }
        )


def _ended_error(request: DecodeRequest, outlets: Outlets) -> BaseException:
    """Why a request ended while its KV was arriving (the error its Generate stream got)."""
    return outlets.of(request.request_id).stream.error or Cancelled(
        f"request {request.name} was cancelled while its KV was arriving"
    )


class KvTransferServicer(kv_pb2_grpc.KvTransferServiceServicer):
    def __init__(
        self,
        instance: DecodeInstance,
        *,
        is_draining: Callable[[], bool] = lambda: False,
        max_message_bytes: int,
    ) -> None:
        """Who may call Pair and TransferKv is the server's check (server.py's policy: the
        hosts of --prefill), made before either runs. `is_draining`: whether this instance
        is stopping (a transfer cancelled then is not the sender's doing).
        `max_message_bytes`: the largest TransferKv message the server receives (Pair says it)."""
        self._instance = instance
        self._max_message_bytes = max_message_bytes
        self._is_draining = is_draining
        self._layout = layout_to_proto(instance.layout, instance.fingerprint)
        self._block_bytes = block_bytes(self._layout)
        # Threads start on first use and idle between transfers.
        self._landing = ThreadPoolExecutor(_LANDING_THREADS, thread_name_prefix="kv-landing")
        # What this instance's pool receives over, by name (the pair's choice is among them).
        self._transports = receivers(
            self._layout,
            instance.cache,
            instance.kv_writer,
            segment=instance.segment,
            ipc_export=instance.ipc_export,
        )

    async def Pair(
        self, request: kv_pb2.PairRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb2.PairResponse:
        """Pick the pair's transport (mili.kv_handoff.transport.answer)."""
        inst = self._instance
        response = answer(
            request, inst.endpoint, self._layout, self._transports, inst.cache.num_blocks
        )
        response.max_message_bytes = self._max_message_bytes
        # DEBUG: the prefill side logs each pair at INFO; decode's log stays one line per event.
        _LOG.debug(
            "KV pair with prefill at %s (%s): transport %s",
            context.peer(),
            request.device,
            response.transport,
        )
        return response

    async def TransferKv(
        self,
        request_iterator: AsyncIterator[Message],
        context: grpc.aio.ServicerContext,
    ) -> kv_pb2.TransferKvResponse:
        messages = aiter(request_iterator)
        first = await anext(messages, None)
        try:
            header, request = self._begin(first)
        except BaseException:
            # A stream's large messages ask for no trim (mili.rpc.malformed), but a refused
            # first one may be all a caller sends: a 50 MB request_id, a chunk before any
            # header. Their buffers go back to the OS.
            heap.release_soon()
            raise
        outlet = self._instance.outlets.hold(request.request_id)  # open: the request waited
        try:
            return await self._receive(request, header, Reader(messages), context)
        except asyncio.CancelledError:
            remaining_s = context.time_remaining()
            error = _broke_off(
                request,
                context.peer(),
                is_draining=self._is_draining(),
                is_late=remaining_s is not None and remaining_s <= 0,
            )
            self._fail(request, error)
            raise
        except BaseException as e:
            self._fail(request, e)
            raise
        finally:
            self._instance.outlets.release(request.request_id, outlet)

    def _begin(self, first: Message | None) -> tuple[kv_pb2.TransferHeader, DecodeRequest]:
        """The transfer's header and its request, now TRANSFERRING."""
        if not isinstance(first, kv_pb2.TransferKvRequest) or first.WhichOneof("kind") != "header":
            raise DataLoss("a KV transfer must start with a header message")
        header = first.header
        num_chars = len(header.request_id)
        if num_chars > MAX_REQUEST_ID_CHARS:
            reason = f"longer than {MAX_REQUEST_ID_CHARS} characters"
            raise InvalidArgument("header.request_id", f"{num_chars} characters", reason)
        # NotFound, PermissionDenied (then the request is left as it was)
        return header, self._instance.table.begin_transfer(header.request_id, header.transfer_token)

    async def _receive(
        self,
        request: DecodeRequest,
        header: kv_pb2.TransferHeader,
        reader: Reader[Message],
        context: grpc.aio.ServicerContext,
    ) -> kv_pb2.TransferKvResponse:
        started = time.perf_counter()  # the header is in
        progress = TransferProgress.start(
            request,
            convert.transfer_header(header, self._layout),
            self._layout.num_layers,
            self._transports,
        )
        transport = self._transports[progress.transport]
        landing = Landing(self._landing, _MAX_LANDING_BYTES)
        is_committed = False
        is_sender_done = False  # it closed its side: its writes into the blocks are over
        if transport.is_in_place:
            await self._accept_in_place(request, context)
        ended = asyncio.ensure_future(
            self._instance.outlets.of(request.request_id).stream.wait_failed()
        )
        try:
            while (message := await self._next(request, reader, landing, ended)) is not None:
                if isinstance(message, ChunkView):
                    await self._land(progress, landing, [message])
                    continue
                kind = message.WhichOneof("kind")
                commit = None
                if kind == "chunk":  # one that parse_transfer_request left to protobuf
                    await self._land(progress, landing, [message.chunk])
                elif kind == "chunks":
                    if not transport.is_in_place:
                        raise DataLoss(
                            f"request {request.name}: a chunk batch in a grpc transfer (only "
                            "in-place transfers announce several chunks per message)"
                        )
                    await self._land(progress, landing, list(message.chunks.chunks))
                    if message.chunks.HasField("commit"):  # its last chunks, then the commit
                        commit = message.chunks.commit
                elif kind == "commit":
                    commit = message.commit
                elif kind == "abort":
                    raise _aborted(request, message.abort, context.peer())
                else:
                    raise DataLoss(f"request {request.name}: a second header mid-transfer")
                if commit is not None:
                    await landing.wait_all()  # DataLoss of any chunk
                    progress.check_complete()
                    # The commit ends the stream: a message after it (a chunk, a second
                    # commit) would otherwise go unread, the call answered OK.
                    if await self._next(request, reader, landing, ended) is not None:
                        raise InvalidArgument(
                            "commit", request.request_id, "must be the transfer's last message"
                        )
                    self._commit(request, commit)
                    is_committed = True
                    _annotate_span(progress)
                    elapsed = time.perf_counter() - started
                    self._instance.metrics.record_transfer(progress.num_bytes, elapsed)
                    return kv_pb2.TransferKvResponse(
                        num_blocks=len(request.received_block_ids), num_bytes=progress.num_bytes
                    )
            # The stream ended without a commit. A sender that died ends it too, and grpc
            # reports that cancel separately, a moment later: wait for it, so a dead sender is
            # UNAVAILABLE (retry elsewhere) and only a sender that really closed early is
            # DATA_LOSS. A chunk that failed to land meanwhile is the better reason.
            await asyncio.wait({landing.failed}, timeout=_CANCEL_GRACE_S)
            landing.raise_failure()
            raise DataLoss(
                f"the KV transfer of request {request.name} ended after "
                f"{plural(progress.num_chunks, 'chunk')} without a commit"
            )
        except Exception as e:
            if transport.is_in_place:
                # The sender may still be writing into the (held) blocks: fail the request now
                # (its Generate stream reports `e` at once), but answer only once the sender
                # stopped. Ending the call under a sender's write would make grpc report
                # INTERNAL to it instead of `e` (see mili.rpc.status), and the initial
                # metadata that could announce `e` already carried the acceptance.
                landing.abort()
                self._fail(request, e)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_IN_PLACE_DRAIN_S):
                        await reader.drain()
                        is_sender_done = True
            raise
        finally:
            ended.cancel()
            reader.cancel()
            landing.abort()  # no-op after a commit: every job is over by then
            if transport.is_in_place:
                self._release_in_place(request, is_committed or is_sender_done)

    async def _accept_in_place(
        self, request: DecodeRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Hold the request's blocks for the sender, who writes into them itself, then tell it
        the header is accepted (codec.ACCEPTED_KEY): before that it writes nothing."""
        if not self._instance.table.pin(request):
            raise _ended_error(request, self._instance.outlets)
        try:
            await context.send_initial_metadata(((ACCEPTED_KEY, "1"),))
        except BaseException:
            self._instance.table.unpin(request)
            raise

    def _release_in_place(self, request: DecodeRequest, is_written: bool) -> None:
        """Let go of the hold `_accept_in_place` took. `is_written`: the sender closed its side
        (after a commit, or after an abort: it sends either only once its last copy into the
        blocks is over), so they go back at once. Else (the call cancelled or broken off) it
        may still be inside one chunk's copy (it checks that the call is alive before each
        chunk, not during one): the blocks go back to the pool only _IN_PLACE_GRACE_S later,
        so no new request is handed a block a stale copy is still landing in."""
        table = self._instance.table
        if is_written:
            table.unpin(request)
        else:
            asyncio.get_running_loop().call_later(_IN_PLACE_GRACE_S, table.unpin, request)

    async def _next(
        self,
        request: DecodeRequest,
        reader: Reader[Message],
        landing: Landing,
        ended: asyncio.Future[BaseException],
    ) -> Message | None:
        """The next message, or None at the end of the stream; raises as soon as the request
        ends (lease, caller gone: `ended`, one wait for the whole transfer) or a chunk fails to
        land, so a quiet sender learns at once, not at its next chunk (the read stays pending:
        see landing.Reader)."""
        landing.raise_failure()
        read = reader.next()
        waits: set[asyncio.Future[Any]] = {read, ended, landing.failed}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        landing.raise_failure()
        if not read.done():
            raise _ended_error(request, self._instance.outlets)
        return reader.take()

    async def _land(
        self, progress: TransferProgress, landing: Landing, chunks: list[Chunk]
    ) -> None:
        """Check the chunks' places in the transfer here, in order; hand their bytes to a
        landing job (checksum, length, scatter) and return without waiting for it. Several
        chunks come in one message only in place (TransferKvRequest.chunks): they are split
        among the landing threads, whose checks then run side by side, unless the transport
        checks them on the device."""
        request = progress.request
        if not chunks:
            raise DataLoss(f"transfer {request.request_id}: a chunks message without a chunk")
        num_bytes = 0
        for chunk in chunks:
            progress.check_chunk(chunk)
            chunk_bytes = 2 * len(chunk.block_ids) * self._block_bytes  # checked when landing
            # Recorded before it lands: a later duplicate is refused, also within this batch.
            # Whatever fails from here on fails the request.
            progress.record(chunk, chunk_bytes)
            num_bytes += chunk_bytes
        table = self._instance.table
        transport = self._transports[progress.transport]
        checksum = progress.checksum

        def land(part: list[Chunk]) -> None:
            # Unpinned here, never by the handler: if the call ends mid-copy, the blocks stay
            # held until the copy is over (see requests.py).
            try:
                if not landing.is_aborted():  # else the request failed: nothing more to write
                    transport.land_all(part, checksum)
            finally:
                table.unpin(request)

        # grpc: one chunk per message, whose bytes the job holds until they landed. In place
        # the bytes are in the pool already: a job holds none, so none counts against
        # _MAX_LANDING_BYTES (which would run the parts of a batch one after the other).
        held = 0 if transport.is_in_place else num_bytes
        # Checks on the device: one job (see the module's docstring).
        threads = 1 if transport.takes_device_tensors else _LANDING_THREADS
        share = ceil_div(len(chunks), threads)
        for start in range(0, len(chunks), share):
            part = chunks[start : start + share]
            await landing.make_room(held)  # raises an earlier chunk's failure
            if not table.pin(request):
                raise _ended_error(request, self._instance.outlets)
            try:
                landing.submit(functools.partial(land, part), held)
            except BaseException:  # not submitted (the executor is shut down): nothing unpins
                table.unpin(request)
                raise

    def _commit(self, request: DecodeRequest, commit: kv_pb2.TransferCommit) -> None:
        inst = self._instance
        if commit.first_token_id >= inst.vocab_size:
            raise InvalidArgument(
                "commit.first_token_id",
                commit.first_token_id,
                f"outside the vocabulary [0, {inst.vocab_size})",
            )
        first_logprobs = None
        if request.params.logprobs is not None:
            if not commit.HasField("first_logprobs"):
                raise InvalidArgument(
                    "commit.first_logprobs", None, "the request asked for logprobs"
                )
            first_logprobs = logprobs_from_proto(commit.first_logprobs)
        if not inst.table.start_running(request):
            raise _ended_error(request, self._instance.outlets)
        try:
            inst.batcher.join(
                request, commit.first_token_id, first_logprobs, inst.outlets.of(request.request_id)
            )
        except BaseException as e:
            inst.table.finish(request)  # RUNNING but never in the batch: nobody else frees it
            inst.outlets.of(request.request_id).stream.fail(e)
            raise

    def _fail(self, request: DecodeRequest, error: BaseException) -> None:
        """End the request (freeing its blocks) and its Generate stream with `error`."""
        if request.state is RequestState.RUNNING:
            return  # committed: the batch thread owns it, and this call's end does not matter
        if self._instance.table.cancel(request):
            self._instance.outlets.of(request.request_id).stream.fail(_for_generate(error))


def _for_generate(error: BaseException) -> BaseException:
    """The transfer's error as the request's Generate stream reports it. What TransferKv refuses
    as its caller's mistake (a malformed message, a header or chunk that breaks the transfer's
    rules) is prefill's, never the client's: DATA_LOSS there, not INVALID_ARGUMENT (a 400 naming
    a field the client never sent) nor grpc's AbortError (UNKNOWN)."""
    if isinstance(error, InvalidArgument):
        return DataLoss(f"the KV transfer from prefill was refused: {error}")
    if isinstance(error, grpc.aio.AbortError):
        return DataLoss("the KV transfer from prefill sent a malformed message")
    return error
