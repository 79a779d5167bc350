"""A gRPC proxy in front of a decode instance that can damage chosen KV transfers.

Every call (DecodeService.Generate/GenerateStream/Info, KvTransferService.TransferKv, health)
is forwarded as
raw bytes to the real decode instance; the proxy runs a grpc.aio server on its own event loop
in a daemon thread, so tests stay synchronous. A frontend started with `--decode <proxy>` sends
both its own Generate calls and prefill's KV destination through it.

For TransferKv, each message is parsed; for a request id with a fault armed (`arm`) the proxy

    corrupt_first / corrupt_last   flips one byte of that chunk's `data`, crc32 left as sent
                                   (with a transport that writes the blocks in place, "shm",
                                   flips bits of the checksum, xxh3_64 or crc32, instead: what
                                   decode holds then differs from what the checksum says)
    drop_commit                    swallows the commit and half-closes the stream to decode
    cut_after_first_chunk          after chunk 0, cancels the call to decode (a broken
                                   connection) and fails prefill's call with UNAVAILABLE

(an in-place sender may announce several chunks in one message, TransferKvRequest.chunks, the
last of them with the commit: the faults find their chunk or the commit inside it, and a cut
forwards the chunks before chunk 1 first)

and records what it did (`events`), so a test can check the fault really happened. Requests
are named by the caller's request_id: the proxy learns which id the frontend minted for each
from the decode requests it forwards (their client_request_id), on Generate calls or started on
the frontend's GenerateStream.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from mili.kv_handoff.codec import ACCEPTED_KEY
from mili.pb.decode.v1 import decode_pb2
from mili.pb.kv.v1 import kv_pb2
from mili.rpc.client import channel_options
from mili.rpc.status import server_status_of, status_header

TRANSFER_KV = "/mili.kv.v1.KvTransferService/TransferKv"
GENERATE = "/mili.decode.v1.DecodeService/Generate"
GENERATE_STREAM = "/mili.decode.v1.DecodeService/GenerateStream"
FAULTS = ("corrupt_first", "corrupt_last", "drop_commit", "cut_after_first_chunk")

# Method path -> (client streaming, server streaming), from the protos the decode server serves.
_KINDS = {
    f"/{service.full_name}/{method.name}": (method.client_streaming, method.server_streaming)
    for file in (decode_pb2.DESCRIPTOR, kv_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR)
    for service in file.services_by_name.values()
    for method in service.methods
}


class _Transfer:
    """What the proxy does to one TransferKv stream."""

    def __init__(self, proxy: FaultProxy) -> None:
        self._proxy = proxy
        self.request_id = ""
        self.fault: str | None = None
        self.num_chunks = 0
        self.is_cut = False
        self._cut_next = False  # a batch held chunk 1: its chunk 0 went on, the cut comes next

    def rewrite(self, raw: bytes) -> bytes | None:
        """The bytes to forward for one message; None: forward nothing (and stop sending)."""
        if self._cut_next:
            self._proxy.record(self.request_id, "cut before chunk 1")
            self.is_cut = True
            return None
        message = kv_pb2.TransferKvRequest.FromString(raw)
        kind = message.WhichOneof("kind")
        if kind == "header":
            self.request_id = self._proxy.label_of(message.header.request_id)
            self.num_chunks = message.header.num_chunks
            self.fault = self._proxy.fault_of(self.request_id)
            return raw
        if self.fault is None:
            return raw
        if kind == "chunk":
            if self._corrupt(message.chunk):
                return message.SerializeToString()
            if self.fault == "cut_after_first_chunk" and message.chunk.seq == 1:
                self._proxy.record(self.request_id, "cut before chunk 1")
                self.is_cut = True
                return None
        if kind == "chunks":  # several in-place chunks in one message
            chunks = message.chunks.chunks
            is_corrupted = any([self._corrupt(chunk) for chunk in chunks])
            if self.fault == "cut_after_first_chunk" and any(c.seq == 1 for c in chunks):
                kept = [c for c in chunks if c.seq < 1]
                if not kept:
                    self._proxy.record(self.request_id, "cut before chunk 1")
                    self.is_cut = True
                    return None
                self._cut_next = True
                return kv_pb2.TransferKvRequest(
                    chunks=kv_pb2.KvChunks(chunks=kept)
                ).SerializeToString()
            if self.fault == "drop_commit" and message.chunks.HasField("commit"):
                message.chunks.ClearField("commit")  # the chunks go on, the stream ends
                self._proxy.record(self.request_id, "dropped the commit")
                return message.SerializeToString()
            if is_corrupted:
                return message.SerializeToString()
        if kind == "commit" and self.fault == "drop_commit":
            self._proxy.record(self.request_id, "dropped the commit")
            return None
        return raw

    def end(self) -> None:
        """The sender half-closed. A cut still pending (the message that held chunk 1 was the
        last, its commit in it) happens now, or decode would see a stream that ended cleanly
        without its commit (DATA_LOSS), not a broken connection."""
        if self._cut_next:
            self._proxy.record(self.request_id, "cut before chunk 1")
            self.is_cut = True

    def _corrupt(self, chunk: kv_pb2.KvChunk) -> bool:
        """Damage `chunk` if it is the one the fault names; whether it was."""
        last = self.num_chunks - 1
        if (self.fault, chunk.seq) not in (("corrupt_first", 0), ("corrupt_last", last)):
            return False
        if chunk.data:
            data = bytearray(chunk.data)
            data[len(data) // 2] ^= 0x5A
            chunk.data = bytes(data)  # crc32 stays the sender's
        elif chunk.xxh3_64:  # written in place (shm): the blocks no longer
            chunk.xxh3_64 ^= 0x5A  # match the checksum (the pair's, XXH3 or CRC)
        else:
            chunk.crc32 ^= 0x5A
        self._proxy.record(self.request_id, f"corrupted chunk {chunk.seq}")
        return True


class FaultProxy:
    """Forwards every call to `upstream`; `address` is where it listens. Use as a context."""

    def __init__(self, upstream: str, port: int = 0) -> None:
        self.upstream = upstream
        self._port = port
        self._lock = threading.Lock()
        self._faults: dict[str, str] = {}
        self._labels: dict[str, str] = {}  # minted request id -> the caller's request_id
        self._events: list[tuple[str, str]] = []
        self._statuses: list[tuple[str, grpc.StatusCode, str]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self.address = self._call(self._start())

    # ---- control, from the test's thread ------------------------------------------------------

    def arm(self, request_id: str, fault: str) -> None:
        assert fault in FAULTS, fault
        with self._lock:
            self._faults[request_id] = fault

    def learn(self, raw_generate_request: bytes) -> None:
        """Remember the caller's id of a request from its decode GenerateRequest."""
        request = decode_pb2.GenerateRequest.FromString(raw_generate_request)
        with self._lock:
            self._labels[request.request_id] = request.client_request_id or request.request_id

    def label_of(self, request_id: str) -> str:
        with self._lock:
            return self._labels.get(request_id, request_id)

    def fault_of(self, request_id: str) -> str | None:
        with self._lock:
            return self._faults.get(request_id)

    def record(self, request_id: str, what: str) -> None:
        with self._lock:
            self._events.append((request_id, what))

    def record_status(self, request_id: str, code: grpc.StatusCode, details: str) -> None:
        """The status decode ended a transfer with (what the proxy relays to prefill)."""
        with self._lock:
            self._statuses.append((request_id, code, details))

    def statuses(self, request_id: str) -> list[tuple[grpc.StatusCode, str]]:
        with self._lock:
            return [(code, details) for rid, code, details in self._statuses if rid == request_id]

    def events(self, request_id: str | None = None) -> list[str]:
        with self._lock:
            return [what for rid, what in self._events if request_id in (None, rid)]

    def close(self) -> None:
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    # ---- the server, on the proxy's loop -----------------------------------------------------

    async def _start(self) -> str:
        options = channel_options()
        self._channel = grpc.aio.insecure_channel(self.upstream, options=options)
        self._server = grpc.aio.server(options=options[:2])
        self._server.add_generic_rpc_handlers([_Handler(self)])
        port = self._server.add_insecure_port(f"127.0.0.1:{self._port}")
        await self._server.start()
        return f"127.0.0.1:{port}"

    async def _stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
        if self._channel is not None:
            await self._channel.close()

    @property
    def channel(self) -> grpc.aio.Channel:
        assert self._channel is not None
        return self._channel


def _forwarded(context: grpc.aio.ServicerContext) -> dict[str, Any]:
    """Timeout and metadata of the incoming call, for the outgoing one."""
    metadata = tuple(
        (m.key, m.value)
        for m in context.invocation_metadata() or ()
        if not m.key.startswith((":", "grpc-")) and m.key not in ("user-agent", "te")
    )
    return {"timeout": context.time_remaining(), "metadata": metadata}


async def _relay_error(context: grpc.aio.ServicerContext, err: grpc.aio.AioRpcError) -> None:
    """End the incoming call with the upstream call's status (rich details included)."""
    code, details, trailers = server_status_of(err)
    await _abort(context, code, details, trailers)


async def _abort(
    context: grpc.aio.ServicerContext,
    code: grpc.StatusCode,
    details: str,
    trailers: Any,
    *,
    announce: bool = False,
) -> None:
    """`announce`: the incoming call streams requests, so the status goes in its initial
    metadata too, as decode's server sends it (see mili.rpc.status): prefill's writes racing
    our status must not lose it either."""
    kept = tuple(
        (key, value)
        for key, value in trailers or ()
        if not key.startswith("grpc-") or key == "grpc-status-details-bin"
    )
    if announce:
        # Fails when the initial metadata went out already (decode's acceptance of an
        # in-place transfer, relayed): then the status alone is what we can send.
        with contextlib.suppress(Exception):
            await context.send_initial_metadata(status_header(code, details, kept))
    await context.abort(code, details, kept)


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, proxy: FaultProxy) -> None:
        self._proxy = proxy

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        kind = _KINDS.get(method)
        if kind is None:
            return None  # UNIMPLEMENTED
        channel = self._proxy.channel
        if kind == (False, False):

            async def unary_unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
                try:
                    return await channel.unary_unary(method)(request, **_forwarded(context))
                except grpc.aio.AioRpcError as err:
                    await _relay_error(context, err)
                    raise

            return grpc.unary_unary_rpc_method_handler(unary_unary)
        if kind == (False, True):

            async def unary_stream(
                request: bytes, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[bytes]:
                if method == GENERATE:
                    self._proxy.learn(request)
                call = channel.unary_stream(method)(request, **_forwarded(context))
                try:
                    async for response in call:
                        yield response
                except grpc.aio.AioRpcError as err:
                    await _relay_error(context, err)
                finally:
                    call.cancel()  # our caller went away: so does the call to decode

            return grpc.unary_stream_rpc_method_handler(unary_stream)
        if kind == (True, False):
            return grpc.stream_unary_rpc_method_handler(self._stream_unary(method))
        if method == GENERATE_STREAM:
            return grpc.stream_stream_rpc_method_handler(self._generate_stream())
        return None

    def _generate_stream(self) -> Any:
        """GenerateStream, forwarded both ways; the proxy learns each started request's id."""
        proxy = self._proxy

        async def stream_stream(
            requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[bytes]:
            call = proxy.channel.stream_stream(GENERATE_STREAM)(**_forwarded(context))

            async def pump() -> None:
                async for raw in requests:
                    for start in decode_pb2.GenerateStreamRequest.FromString(raw).starts:
                        proxy.learn(start.request.SerializeToString())
                    await call.write(raw)
                with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):
                    await call.done_writing()

            pumping = asyncio.ensure_future(pump())
            try:
                async for response in call:
                    yield response
            except grpc.aio.AioRpcError as err:
                await _relay_error(context, err)
            finally:
                pumping.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pumping
                call.cancel()  # our caller went away: so does the call to decode

        return stream_stream

    def _stream_unary(self, method: str) -> Any:
        proxy = self._proxy

        async def stream_unary(
            requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
        ) -> bytes:
            call = proxy.channel.stream_unary(method)(**_forwarded(context))
            transfer = _Transfer(proxy) if method == TRANSFER_KV else None

            async def pump() -> None:
                async for raw in requests:
                    out = raw if transfer is None else transfer.rewrite(raw)
                    if out is None:
                        break
                    if call.done():
                        return
                    await call.write(out)
                else:
                    if transfer is not None:
                        transfer.end()
                if transfer is not None and transfer.is_cut:
                    call.cancel()  # the connection to decode "breaks"
                    return
                with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):
                    await call.done_writing()

            async def relay_acceptance() -> None:
                # Decode's go-ahead for an in-place (shm) transfer: prefill writes nothing into
                # decode's pool before it sees it.
                metadata = await call.initial_metadata()
                accepted = tuple((k, v) for k, v in metadata or () if k == ACCEPTED_KEY)
                if accepted:
                    await context.send_initial_metadata(accepted)

            pumping = asyncio.ensure_future(pump())
            finished = asyncio.ensure_future(call.code())
            relaying = asyncio.ensure_future(relay_acceptance())
            try:
                # The pump ends when the sender half-closes, or at a cut; decode may answer (its
                # error) before either, ending the call.
                await asyncio.wait({pumping, finished}, return_when=asyncio.FIRST_COMPLETED)
                if transfer is not None and transfer.is_cut:
                    await _abort(
                        context,
                        grpc.StatusCode.UNAVAILABLE,
                        "fault proxy: connection to decode lost",
                        (),
                        announce=True,
                    )
                try:
                    return await call
                except grpc.aio.AioRpcError as err:
                    # decode's status, also when our write raced it (see mili.rpc.status)
                    code, details, trailers = server_status_of(err)
                    if transfer is not None:
                        proxy.record_status(transfer.request_id, code, details)
                    await _abort(context, code, details, trailers, announce=True)
                    raise
            finally:
                for task in (pumping, finished, relaying):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                call.cancel()

        return stream_unary
