"""The KV transfer client: streams one prompt's KV to decode's KvTransferService.TransferKv.

    worker thread ──send_blocks/finish/fail──▶ call_soon_threadsafe ─▶ asyncio.Queue
                                                                          │ (event loop)
    TransferKv stream:  header ─▶ chunk seq 0, 1, ... (one per layer per prompt chunk) ─▶ commit
                                  ▲ encoded (one copy + checksum: the pair's transport,
                                    mili.kv_handoff) on the encoder threads, up to 3 at once,
                                    written in order

The header goes out as soon as `run` starts, before the prompt's first forward, so decode checks
the layout and its reservation while we compute; each layer's chunk follows as the layer
completes. Decode's verdict ends the transfer at any point: the call's done-callback wakes the
loop, so a rejection is seen even while we wait for compute. Errors come back as domain errors
with decode's code and a message naming its address. A transfer we give up on ourselves (the
compute failed, the instance is stopping, our caller cancelled) ends with an `abort` message
carrying our status before the call is cancelled: decode then fails the request with it, and
tells it from a sender that died (a stream broken off without one).

In-place transports (shm, cuda-ipc) write into decode's blocks themselves: the first write waits
for decode's acceptance of the header (codec.ACCEPTED_KEY in its initial metadata), which
arrived while the first layer was computed. Their chunks still encoding when the first token
comes go out with the commit, in one message (KvChunks.commit).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, NamedTuple

import grpc
import torch

from mili.arith import ceil_div
from mili.engine.logprobs import TokenLogprobs
from mili.errors import (
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    MiliError,
    NotFound,
    PeerUnavailable,
    ResourceExhausted,
)
from mili.kv_handoff.codec import ACCEPTED_KEY, batch_in_place
from mili.kv_handoff.kv_part import KvPart
from mili.pb.common.v1 import sampling_pb2
from mili.pb.kv.v1 import kv_pb2
from mili.rpc.sampling import logprobs_to_proto
from mili.rpc.status import code_of, server_status_of
from services.prefill.pairing import GRPC_PAIRING, Pairing
from services.prefill.task import FirstToken, PrefillTask

_SERVICE = kv_pb2.DESCRIPTOR.services_by_name["KvTransferService"]
# Messages go out pre-serialized (by the pair's transport), so the call is made
# without the generated stub.
_TRANSFER_KV = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['TransferKv'].name}"


class TransferResult(NamedTuple):
    first: FirstToken
    kv_bytes: int  # payload bytes of every chunk
    transfer_ms: float  # first chunk written -> decode's acknowledgement


class _Blocks(NamedTuple):
    layer: int  # the first of kv's layers: one chunk each
    first_block: int
    kv: torch.Tensor  # [num_layers, 2 (K, V), n, block_size, num_kv_heads, head_dim]
    ready: Callable[[], None] | None


class _Failed(NamedTuple):
    exc: BaseException


_CALL_ENDED = object()  # the TransferKv call finished (decode answered or the stream broke)
_ENCODED = object()  # a chunk's encoding finished (wakes `_stream` to write it)
# Chunks being encoded or encoded and not yet written, per transfer: two keep both encoder
# threads busy while a third waits to be written; each is one layer of a prompt chunk.
_MAX_ENCODING = 3
# The same for in-place transports (shm, cuda-ipc), whose encoded chunks hold no KV: enough to
# keep the encoder threads busy while the loop writes, and to announce several chunks per
# message when they queue up (TransferKvRequest.chunks). There a bound counts encoder jobs,
# each of one chunk or of a share of a backlog (see `_stream`).
_MAX_ENCODING_IN_PLACE = 8
# How long a transfer we give up on waits for decode to answer its abort before the call is
# cancelled (decode answers at once; one that stopped reading does not delay us longer).
_ABORT_ANSWER_S = 0.5

# Decode's status -> the error our caller gets (the same code, but one; anything unexpected reads
# as decode being unusable, which the frontend handles by trying another instance).
_ERRORS: dict[grpc.StatusCode, type[MiliError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.DATA_LOSS: DataLoss,
    # Decode refused a message of ours: our fault, not our caller's (whose request has no
    # such field), as decode tells the request's own stream too.
    grpc.StatusCode.INVALID_ARGUMENT: DataLoss,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


class KvSender:
    """One prompt's transfer; a `KvSink` for the worker. Use once: `await run()`."""

    def __init__(
        self,
        task: PrefillTask,
        *,
        channel: grpc.aio.Channel,
        encoder: Executor,
        layout: kv_pb2.KvLayout,
        num_chunks: int,
        timeout_s: float,
        pairing: Pairing = GRPC_PAIRING,
        encoder_threads: int = 2,
    ) -> None:
        """`encoder_threads`: how many threads `encoder` runs; a backlog of in-place chunks is
        split into that many jobs."""
        self._task = task
        self._pairing = pairing
        self._channel = channel
        self._encoder = encoder
        self._encoder_threads = max(1, encoder_threads)
        self._layout = layout
        self._num_chunks = num_chunks
        self._timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._is_closed = False
        self._is_given_up = False  # `run` stops the stream: it writes nothing more
        # Every encode job, as the executor runs it: an in-place one not done may be writing
        # into decode's blocks (its asyncio future may be cancelled while it runs on).
        self._jobs: list[concurrent.futures.Future[Any]] = []

    # ---- KvSink: called from the worker thread -----------------------------------------------

    @property
    def takes_device_tensors(self) -> bool:
        """cuda-ipc copies device to device: the worker hands over its GPU gather as is, every
        layer at once after the forward."""
        return self._pairing.kv.takes_device_tensors

    def send_blocks(
        self, layer: int, first_block: int, kv: torch.Tensor, ready: Callable[[], None] | None
    ) -> None:
        self._post(_Blocks(layer, first_block, kv, ready))

    def finish(self, first: FirstToken) -> None:
        self._post(first)

    def fail(self, exc: BaseException) -> None:
        self._post(_Failed(exc))

    def _post(self, item: object) -> None:
        if self._is_closed:
            return  # the transfer already ended; drop the late KV
        # RuntimeError: the event loop is closed, the process is shutting down.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._deliver, item)

    def _deliver(self, item: object) -> None:
        # On the loop. Once the transfer ended nothing reads the queue: drop the item, so the
        # host copies it holds (staging ring spans on a GPU) go back at once.
        if not self._is_closed:
            self._queue.put_nowait(item)

    # ---- the transfer ------------------------------------------------------------------------

    async def run(
        self, start_compute: Callable[[], None], stop_compute: Callable[[], None]
    ) -> TransferResult:
        """Call `start_compute` (which hands the prompt to the worker), open the stream and
        send the header, stream the chunks and the commit; return once decode acknowledged.
        On failure `stop_compute` (which takes the prompt from the worker) is called at once,
        before decode's answer to our abort is awaited.

        Raises a MiliError carrying decode's status code (UNAVAILABLE when it is unreachable or
        went away), or what `start_compute` or the worker failed with. Cancelling `run` ends
        the call too. Either way, once the header is out, decode is told first (`_abort`) and
        fails the request with our status, freeing its blocks.
        """
        transfer_kv = self._channel.stream_unary(
            _TRANSFER_KV, response_deserializer=kv_pb2.TransferKvResponse.FromString
        )
        call = transfer_kv(timeout=self._timeout_s)
        call.add_done_callback(self._on_done)
        task = self._task
        pairing = self._pairing
        header = kv_pb2.TransferHeader(
            request_id=task.request_id,
            layout=self._layout,
            num_tokens=len(task.prompt_token_ids),
            num_chunks=self._num_chunks,
            transfer_token=task.transfer_token,
            transport=pairing.transport,
            checksum=pairing.checksum,
        )
        is_open = False  # the header is out: decode holds the request for this call
        stream: asyncio.Future[TransferResult] | None = None
        try:
            # The prompt goes to the worker first: its forward does not wait for the stream to
            # open (a round trip to decode). Chunks go out after the header all the same (only
            # `_stream`, below, writes them), and a transfer ended before the header leaves the
            # worker's output unsent (`_is_closed`); decode checks the layout and its
            # reservation while we compute.
            start_compute()
            await self._write(call, kv_pb2.TransferKvRequest(header=header).SerializeToString())
            is_open = True
            # On a task of its own: a cancel of ours landing in one of its writes would cancel
            # the call (grpc.aio does so), and decode would see the stream break off instead of
            # our abort (and keep in-place blocks for its grace period). It stops between
            # writes instead (`_give_up`).
            stream = asyncio.ensure_future(self._stream(call))
            return await asyncio.shield(stream)
        except grpc.aio.AioRpcError as err:
            raise self._error(err) from None
        except BaseException as exc:
            self._is_closed = True  # no more writes into decode's blocks, even while we abort
            stop_compute()  # nor steps for a prompt nobody wants, while decode answers
            if stream is not None and not stream.done():
                await self._give_up(stream)
            # We give up, decode did not: tell it why, once no write of ours is under way (an
            # abort says so: decode takes its blocks back at once). A job still writing past
            # the wait: the call is cancelled instead, and decode keeps them a while.
            if is_open and not call.done() and await self._writes_over():
                await self._abort(call, exc)
            raise
        finally:
            self._is_closed = True
            if stream is not None:
                stream.cancel()  # gave up waiting for it (a no-op once it ended)
                stream.add_done_callback(_retrieve)
            # A job's error holds its frame, and so this sender, which held the job: a cycle
            # only a full collection frees, with the pairing and the KV copies it holds (a
            # restarted decode's whole shm pool stayed mapped). Dropped here, nothing cycles.
            self._jobs.clear()
            while not self._queue.empty():  # handed over, never sent: let their memory go
                self._queue.get_nowait()
            if not call.done():
                call.cancel()

    async def _stream(self, call: grpc.aio.StreamUnaryCall) -> TransferResult:
        """Encode chunks on the encoder threads as they come (up to _MAX_ENCODING at once, so
        both threads work when layers queue up) and write them in order as they finish. The
        threads are handed more chunks before each write, so encoding overlaps the writes.

        In place, chunks that queued up (layers handed over faster than they are encoded, or
        all at once) go to the threads as one job per thread, each encoding its share one
        chunk after the other: a thread hand-off each way per job instead of per chunk, and
        fewer, larger messages to decode (docs/benchmarks.md, issue 15's fifth round). A chunk
        that comes alone, as the worker hands layers over during the forward, goes alone."""
        seq = kv_bytes = 0
        first_sent_at: float | None = None
        waiting: collections.deque[_Blocks] = collections.deque()  # handed over, not encoding
        # per job: the encoded chunk messages, in order, and their payload bytes
        encoding: collections.deque[asyncio.Future[tuple[list[bytes], int]]] = collections.deque()

        is_in_place = self._pairing.kv.is_in_place
        # In place, an encoded chunk is a few bytes (the KV is in decode's pool already): more
        # may wait, and the ones done by the time we write go out as one message.
        max_encoding = _MAX_ENCODING_IN_PLACE if is_in_place else _MAX_ENCODING
        # In place, the first write into decode's blocks waits for its acceptance (`_accepted`).
        is_accepted = not is_in_place

        def feed() -> None:
            """Start encoding waiting chunks, in order, while fewer than max_encoding jobs are
            encoding or encoded and not written (which bounds the encoded bytes held); none
            once `run` gave the transfer up (an in-place job would write decode's blocks)."""
            nonlocal seq
            if self._is_given_up:
                raise _GivenUp
            share = 1  # chunks per job
            if is_in_place:
                share = ceil_div(len(waiting), self._encoder_threads)
            while waiting and len(encoding) < max_encoding:
                job = [waiting.popleft() for _ in range(min(share, len(waiting)))]
                running = self._encoder.submit(self._encode_all, seq, job)
                self._jobs.append(running)
                future = asyncio.wrap_future(running, loop=self._loop)
                future.add_done_callback(lambda _: self._queue.put_nowait(_ENCODED))
                encoding.append(future)
                seq += sum(blocks.kv.shape[0] for blocks in job)  # a chunk per layer

        async def write_first() -> None:
            """Write the first chunk once encoded (with the ones encoded after it, in place)."""
            nonlocal kv_bytes, first_sent_at
            messages, num_data = await encoding.popleft()  # raises the encoder's error
            while is_in_place and encoding and encoding[0].done():
                more, more_data = encoding.popleft().result()
                messages += more
                num_data += more_data
            feed()  # the threads encode the next chunks while this one is on the wire
            first_sent_at = first_sent_at or time.perf_counter()
            # several messages only in place (one chunk per job over grpc)
            message = messages[0] if len(messages) == 1 else batch_in_place(messages)
            await self._write(call, message)
            kv_bytes += num_data

        try:
            while True:
                # Take in every chunk handed over so far before starting encodes (a backlog
                # is split among the threads as a whole); write whatever is encoded.
                if self._queue.empty():
                    feed()
                    if encoding and encoding[0].done():
                        await write_first()
                        continue
                item = await self._queue.get()
                if item is _ENCODED:
                    continue
                if item is _CALL_ENDED:
                    await self._ended(call)
                elif isinstance(item, _Failed):
                    raise item.exc
                elif isinstance(item, _Blocks):
                    if not is_accepted:
                        await self._accepted(call)
                        is_accepted = True
                    waiting.append(item)
                else:
                    assert isinstance(item, FirstToken)
                    feed()
                    # In place, the chunks still encoding go out with the commit, in one
                    # message (KvChunks.commit); over grpc each as it comes (write_first
                    # feeds the rest as it goes), then the commit.
                    last: list[bytes] = []
                    while encoding:
                        if not is_in_place:
                            await write_first()
                            continue
                        messages, num_data = await encoding.popleft()  # the encoder's error
                        last += messages
                        kv_bytes += num_data
                        feed()
                    if seq != self._num_chunks:
                        raise AssertionError(f"sent {seq} KV chunks, announced {self._num_chunks}")
                    if self._is_given_up:  # no commit for a transfer given up meanwhile
                        raise _GivenUp
                    first_sent_at = first_sent_at or time.perf_counter()
                    if last:
                        message = batch_in_place(last, _commit(item))
                    else:
                        message = kv_pb2.TransferKvRequest(commit=_commit(item)).SerializeToString()
                    # Not _write: decode may acknowledge before this write returns (an in-place
                    # transfer's commit lands at once), which is no early end; `await call`
                    # below reads whatever decode answered.
                    with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):
                        await call.write(message)
                        await call.done_writing()
                    await call  # decode's acknowledgement (raises its error status)
                    sent_ms = (time.perf_counter() - first_sent_at) * 1e3
                    return TransferResult(item, kv_bytes, sent_ms)
        finally:
            for future in encoding:  # the transfer failed: their results are not wanted
                future.add_done_callback(_retrieve)

    def _encode_all(self, seq: int, job: list[_Blocks]) -> tuple[list[bytes], int]:
        """Runs on an encoder thread: the chunks of `job` (a layer each, numbered from `seq`)
        handed to the
        pair's transport in one call, so that it can batch them (cuda-ipc reads its checksums
        back once); the byte copies and checksums stay off the model thread and the event loop
        (both release the GIL on large buffers). Block j of the prompt goes to decode's block
        prompt_block_ids[j]."""
        parts = []
        for blocks in job:
            if blocks.ready is not None:
                blocks.ready()
            n = blocks.kv.shape[2]
            block_ids = self._task.prompt_block_ids[blocks.first_block : blocks.first_block + n]
            parts.append(KvPart(blocks.layer, block_ids, blocks.kv))
        if self._is_closed:  # the transfer ended: write nothing more into decode's blocks
            raise Cancelled(f"the KV transfer of request {self._task.name} ended")
        return self._pairing.kv.encode_all(
            self._task.request_id, seq, parts, self._pairing.checksum
        )

    async def _give_up(self, stream: asyncio.Future[TransferResult]) -> None:
        """Stop `stream` at its next write or queue read, waiting at most _ABORT_ANSWER_S for
        a write under way to finish (decode may be slow to read it)."""
        self._is_given_up = True
        self._queue.put_nowait(_Failed(_GivenUp()))  # wakes it if it waits for an item
        await asyncio.wait({stream}, timeout=_ABORT_ANSWER_S)

    async def _writes_over(self) -> bool:
        """Whether the in-place encode jobs under way (each may be copying into decode's
        blocks) ended within _ABORT_ANSWER_S; over grpc a job writes only our own bytes."""
        running = [job for job in self._jobs if not job.done()]
        if not running or not self._pairing.kv.is_in_place:
            return True
        waits = [asyncio.wrap_future(job, loop=self._loop) for job in running]
        for wait in waits:  # their errors (Cancelled: the transfer ended) are not news
            wait.add_done_callback(_retrieve)
        _, pending = await asyncio.wait(waits, timeout=_ABORT_ANSWER_S)
        return not pending

    async def _abort(self, call: grpc.aio.StreamUnaryCall, exc: BaseException) -> None:
        """End the transfer on purpose: an abort message with our status for the request (what
        `exc` maps to; CANCELLED when our caller cancelled), then the end of our side, and
        decode's answer awaited for at most _ABORT_ANSWER_S. Without the message decode could
        not tell us giving up from our process dying (its connection breaking off)."""
        if isinstance(exc, asyncio.CancelledError):
            code = grpc.StatusCode.CANCELLED
            why = f"prefill's caller cancelled request {self._task.name} (or its deadline passed)"
        else:
            code = code_of(exc)
            why = str(exc) or type(exc).__name__
        abort = kv_pb2.TransferAbort(code=code.value[0], message=why)
        # Exception: the call ended meanwhile, or decode did not answer in time (TimeoutError);
        # either way `run` cancels the call next. A second cancel of our task goes through.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_ABORT_ANSWER_S):
                await call.write(kv_pb2.TransferKvRequest(abort=abort).SerializeToString())
                await call.done_writing()
                await call  # decode's status for the aborted request: ours, not news

    async def _accepted(self, call: grpc.aio.StreamUnaryCall) -> None:
        """Wait until decode accepted the header of an in-place transfer (codec.ACCEPTED_KEY):
        only then are the blocks ours to write. It answered while we computed the first layer,
        so this costs no time; a refusal raises decode's status."""
        metadata = await call.initial_metadata()
        if any(key == ACCEPTED_KEY for key, _ in metadata or ()):
            return
        await self._ended(call)  # raises decode's status; its metadata held no acceptance

    def _on_done(self, call: grpc.aio.StreamUnaryCall) -> None:
        """The call finished: wake `_stream` (also while it waits for compute)."""
        self._queue.put_nowait(_CALL_ENDED)

    async def _write(self, call: grpc.aio.StreamUnaryCall, message: bytes) -> None:
        if self._is_given_up:
            raise _GivenUp
        # InvalidStateError: the call had ended; AioRpcError: it ended during this write (see
        # `_error`). Either way `_ended` reports decode's status.
        with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):
            await call.write(message)
        if call.done():
            await self._ended(call)

    async def _ended(self, call: grpc.aio.StreamUnaryCall) -> None:
        """The call finished before our commit: raise decode's error status."""
        await call  # raises AioRpcError unless decode answered OK
        raise DataLoss(
            f"decode at {self._task.address} acknowledged the KV transfer of request "
            f"{self._task.name} before its commit"
        )

    def _error(self, err: grpc.aio.AioRpcError) -> MiliError:
        # grpc.aio quirk: a write that races decode's error status fails, and grpc then sets the
        # call's status to INTERNAL "Internal error from Core", also over decode's status when
        # that had arrived first. Decode announces its status in the initial metadata as well
        # (mili.rpc.interceptor), which grpc never overwrites: server_status_of reads it there.
        code, details, _ = server_status_of(err)
        what = (
            f"KV transfer of request {self._task.name} to decode at "
            f"{self._task.address} failed: {code.name}: {details}"
        )
        if code is grpc.StatusCode.CANCELLED:
            what += " (decode cancelled the transfer: it stopped or restarted)"
        error = _ERRORS.get(code)
        if error is None:
            # Decode is unusable, not us: the frontend must not take this instance out of
            # routing for it (ErrorInfo PEER_UNAVAILABLE).
            return PeerUnavailable(what, peer=self._task.address)
        return error(what)


class _GivenUp(Exception):
    """Raised in the stream's task when `run` gives the transfer up (its own error is raised)."""


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Read an abandoned encoding's outcome, so asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


def _commit(first: FirstToken) -> kv_pb2.TransferCommit:
    return kv_pb2.TransferCommit(first_token_id=first.token_id, first_logprobs=logprobs(first))


def logprobs(first: FirstToken) -> sampling_pb2.Logprobs | None:
    """The first token's Logprobs message, or None when none were asked for."""
    if first.logprob is None:
        return None
    return logprobs_to_proto(first.token_id, TokenLogprobs(first.logprob, first.top_logprobs or []))
