"""gRPC edge of KV transfer: prefill streams a request's prompt KV into its reserved blocks.

    header  request must be WAITING (-> TRANSFERRING), layouts equal, num_tokens = prompt length
    chunk*  seq 0, 1, 2, ... ; request id matches ; blocks within the prompt's reservation ;
            CRC and length checked (kv_codec.decode_chunk) ; scattered into the cache in a
            worker thread, the request pinned meanwhile
    commit  every (layer, prompt block) written exactly once, chunk count = header.num_chunks;
            then the request joins the batch with prefill's first token

Any failure after the header fails the request too: its Generate stream ends with the same
status and its blocks are freed. So does a stream that breaks off (the sender died).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from mili.errors import Cancelled, DataLoss, InvalidArgument, Unavailable
from mili.kv.v1 import kv_pb2, kv_pb2_grpc
from mili.rpc.kv_codec import check_compatible, decode_chunk
from services.decode import convert
from services.decode.instance import DecodeInstance
from services.decode.requests import DecodeRequest, RequestState

_CANCEL_GRACE_S = 0.1


class _Progress:
    """What one transfer has written so far; raises DataLoss on anything out of place."""

    def __init__(self, request: DecodeRequest, num_layers: int, num_chunks: int) -> None:
        self.request = request
        self.num_chunks_expected = num_chunks
        self.num_chunks = 0
        self.num_bytes = 0
        self._prompt_blocks = set(request.prompt_block_ids)
        self._expected = {(layer, b) for layer in range(num_layers) for b in self._prompt_blocks}
        self._written: set[tuple[int, int]] = set()

    def check_chunk(self, chunk: kv_pb2.KvChunk) -> None:
        where = f"request {self.request.request_id!r} chunk {chunk.seq}"
        if chunk.seq != self.num_chunks:
            raise DataLoss(
                f"{where}: expected chunk {self.num_chunks} (chunk lost, duplicated or reordered)"
            )
        if chunk.seq >= self.num_chunks_expected:
            raise DataLoss(f"{where}: the header announced {self.num_chunks_expected} chunks")
        if chunk.request_id != self.request.request_id:
            raise DataLoss(f"{where}: carries request id {chunk.request_id!r}")
        foreign = [b for b in chunk.block_ids if b not in self._prompt_blocks]
        if foreign:
            raise DataLoss(
                f"{where}: block ids {foreign[:8]} are not among the request's prompt blocks "
                f"{self.request.prompt_block_ids}"
            )
        seen: set[int] = set()
        for block in chunk.block_ids:
            if block in seen or (chunk.layer, block) in self._written:
                raise DataLoss(f"{where}: layer {chunk.layer} block {block} sent more than once")
            seen.add(block)

    def record(self, chunk: kv_pb2.KvChunk) -> None:
        self._written.update((chunk.layer, b) for b in chunk.block_ids)
        self.num_chunks += 1
        self.num_bytes += len(chunk.data)

    def check_complete(self) -> None:
        where = f"request {self.request.request_id!r}"
        if self.num_chunks != self.num_chunks_expected:
            raise DataLoss(
                f"{where}: commit after {self.num_chunks} chunks, the header announced "
                f"{self.num_chunks_expected}"
            )
        missing = sorted(self._expected - self._written)
        if missing:
            layer, block = missing[0]
            raise DataLoss(
                f"{where}: {len(missing)} (layer, block) pairs never sent, e.g. layer {layer} "
                f"block {block}"
            )


def _ended_error(request: DecodeRequest) -> BaseException:
    """Why a request ended while its KV was arriving (the error its Generate stream got)."""
    return request.stream.error or Cancelled(
        f"request {request.request_id!r} was cancelled while its KV was arriving"
    )


class KvTransferServicer(kv_pb2_grpc.KvTransferServiceServicer):
    def __init__(self, instance: DecodeInstance) -> None:
        self._instance = instance
        self._layout = convert.layout(instance.layout, instance.fingerprint)

    async def TransferKv(
        self,
        request_iterator: AsyncIterator[kv_pb2.TransferKvRequest],
        context: grpc.aio.ServicerContext,
    ) -> kv_pb2.TransferKvResponse:
        messages = aiter(request_iterator)
        first = await anext(messages, None)
        if first is None or first.WhichOneof("kind") != "header":
            raise DataLoss("a KV transfer must start with a header message")
        header = first.header
        request = self._instance.table.begin_transfer(header.request_id)  # NotFound
        try:
            return await self._receive(request, header, messages)
        except asyncio.CancelledError:
            self._fail(
                request,
                Unavailable(
                    f"the KV transfer of request {request.request_id!r} broke off mid-way "
                    "(the prefill instance went away?); retry the request"
                ),
            )
            raise
        except BaseException as e:
            self._fail(request, e)
            raise

    async def _receive(
        self,
        request: DecodeRequest,
        header: kv_pb2.TransferHeader,
        messages: AsyncIterator[kv_pb2.TransferKvRequest],
    ) -> kv_pb2.TransferKvResponse:
        check_compatible(
            self._layout,
            header.layout,
            local_name="this decode instance",
            remote_name="the prefill instance",
        )
        if header.num_tokens != request.num_prompt_tokens:
            raise InvalidArgument(
                "header.num_tokens",
                header.num_tokens,
                f"request {request.request_id!r} has {request.num_prompt_tokens} prompt tokens",
            )
        progress = _Progress(request, self._layout.num_layers, header.num_chunks)
        while (message := await self._next(request, messages)) is not None:
            kind = message.WhichOneof("kind")
            if kind == "chunk":
                await self._write_chunk(progress, message.chunk)
            elif kind == "commit":
                progress.check_complete()
                self._commit(request, message.commit)
                return kv_pb2.TransferKvResponse(
                    num_blocks=request.num_prompt_blocks, num_bytes=progress.num_bytes
                )
            else:
                raise DataLoss(f"request {request.request_id!r}: a second header mid-transfer")
        # The stream ended without a commit. A sender that died ends it too, and grpc reports
        # that cancel separately, a moment later: wait for it, so a dead sender is UNAVAILABLE
        # (retry elsewhere) and only a sender that really closed early is DATA_LOSS.
        await asyncio.sleep(_CANCEL_GRACE_S)
        raise DataLoss(
            f"the KV transfer of request {request.request_id!r} ended after "
            f"{progress.num_chunks} chunks without a commit"
        )

    async def _next(
        self, request: DecodeRequest, messages: AsyncIterator[kv_pb2.TransferKvRequest]
    ) -> kv_pb2.TransferKvRequest | None:
        """The next message, or None at the end of the stream; raises as soon as the request
        ends (lease, caller gone), so a quiet sender learns at once, not at its next chunk."""
        read = asyncio.ensure_future(anext(messages, None))
        ended = asyncio.ensure_future(request.stream.wait_failed())
        try:
            await asyncio.wait({read, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not read.done():
                read.cancel()  # the handler is ending: nobody reads this stream again
        if read.cancelled() or not read.done():
            raise _ended_error(request)
        return read.result()

    async def _write_chunk(self, progress: _Progress, chunk: kv_pb2.KvChunk) -> None:
        progress.check_chunk(chunk)
        k, v = decode_chunk(chunk, self._layout)  # DataLoss: short or corrupt
        request = progress.request
        table = self._instance.table
        if not table.pin(request):
            raise _ended_error(request)
        block_ids = list(chunk.block_ids)
        batcher = self._instance.batcher

        def scatter() -> None:
            # Unpinned here, not in the handler: if the call is cancelled mid-copy, the blocks
            # must stay held until the copy is over (see requests.py).
            try:
                batcher.scatter(chunk.layer, block_ids, k, v)
            finally:
                table.unpin(request)

        await asyncio.to_thread(scatter)  # a copy of up to many MB: never on the event loop
        progress.record(chunk)

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
            first_logprobs = convert.logprobs_from_proto(commit.first_logprobs)
        if not inst.table.start_running(request):
            raise _ended_error(request)
        try:
            inst.batcher.join(request, commit.first_token_id, first_logprobs)
        except BaseException as e:
            inst.table.finish(request)  # RUNNING but never in the batch: nobody else frees it
            request.stream.fail(e)
            raise

    def _fail(self, request: DecodeRequest, error: BaseException) -> None:
        """End the request (freeing its blocks) and its Generate stream with `error`."""
        if request.state is RequestState.RUNNING:
            return  # committed: the batch thread owns it, and this call's end does not matter
        if self._instance.table.cancel(request):
            request.stream.fail(error)
