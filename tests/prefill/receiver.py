"""A KV receiver for the prefill tests: a real grpc.aio KvTransferService that does what decode
must do with a transfer (check the layout and the reservation, validate every chunk with
`codec.decode_chunk`, scatter it into its own KVCache) and records what arrived and when.

Knobs inject the failures the prefill service must survive: a corrupt chunk, a stall after some
chunks, a held acknowledgement. Run as a script (`python -m tests.prefill.receiver`) it is a
bare "stall after the first chunk" receiver a test can SIGKILL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from mili.pb.kv.v1 import kv_pb2, kv_pb2_grpc
from mili.rpc.kv_layout import check_compatible
from mili.rpc.status import status_header

if TYPE_CHECKING:  # the killable script runs without torch
    from mili.engine.model.kv_cache import KVCache


@dataclass
class Arrival:
    seq: int
    layer: int
    block_ids: list[int]
    num_bytes: int
    at: float  # time.perf_counter() on arrival


@dataclass
class Transfer:
    """What one TransferKv call delivered."""

    header: kv_pb2.TransferHeader
    chunks: list[Arrival] = field(default_factory=list)
    commit: kv_pb2.TransferCommit | None = None
    # "open", "ok", an error code name, "cancelled", or "aborted: CODE" (the sender's abort)
    status: str = "open"


class KvReceiver(kv_pb2_grpc.KvTransferServiceServicer):
    """Reservations, validation and a KV cache, as decode keeps them (`cache` may be None for a
    receiver that only checks framing)."""

    def __init__(self, layout: kv_pb2.KvLayout, cache: KVCache | None = None) -> None:
        self.layout = layout
        self.cache = cache
        self.reservations: dict[str, list[int]] = {}
        self.transfers: dict[str, Transfer] = {}
        self.reserve_any = False  # accept every request id (the killable script)
        self.corrupt_seq: int | None = None  # flip a byte of this chunk before validating it
        self.stall_after: int | None = None  # stop reading after this many chunks ...
        self.resume = asyncio.Event()  # ... until this is set
        self.hold_ack = asyncio.Event()  # the acknowledgement waits for this
        self.hold_ack.set()
        self.got_chunk = asyncio.Event()
        self.validate = True  # False: framing only (the killable script never imports torch)
        self.on_chunk: Callable[[Arrival], None] | None = None
        # Answer the commit with this status (as decode refuses a malformed commit)
        self.refuse_commit: tuple[grpc.StatusCode, str] | None = None

    def reserve(self, request_id: str, block_ids: list[int]) -> None:
        self.reservations[request_id] = list(block_ids)

    async def TransferKv(
        self,
        request_iterator: AsyncIterator[kv_pb2.TransferKvRequest],
        context: grpc.aio.ServicerContext,
    ) -> kv_pb2.TransferKvResponse:
        opened: list[Transfer] = []
        try:
            return await self._receive(request_iterator, context, opened)
        except asyncio.CancelledError:  # prefill cancelled the call (or we are stopping)
            for transfer in opened:
                transfer.status = "cancelled"
                self.reservations.pop(transfer.header.request_id, None)
            raise

    async def _receive(
        self,
        requests: AsyncIterator[kv_pb2.TransferKvRequest],
        context: grpc.aio.ServicerContext,
        opened: list[Transfer],
    ) -> kv_pb2.TransferKvResponse:
        iterator = aiter(requests)
        first = await anext(iterator)
        if first.WhichOneof("kind") != "header":
            await _abort(context, grpc.StatusCode.DATA_LOSS, "first message is not a header")
        header = first.header
        transfer = self.transfers[header.request_id] = Transfer(header)
        opened.append(transfer)

        async def fail(code: grpc.StatusCode, message: str) -> None:
            transfer.status = code.name
            self.reservations.pop(header.request_id, None)  # decode frees on failure
            await _abort(context, code, message)

        if self.validate:
            try:
                check_compatible(
                    self.layout, header.layout, local_name="decode", remote_name="prefill"
                )
            except Exception as err:
                await fail(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        if self.reserve_any:
            self.reservations.setdefault(header.request_id, [])
        block_ids = self.reservations.get(header.request_id)
        if block_ids is None:
            await fail(grpc.StatusCode.NOT_FOUND, f"no reservation for {header.request_id!r}")
        assert block_ids is not None
        num_bytes = 0
        async for message in iterator:
            kind = message.WhichOneof("kind")
            if kind == "commit":
                if len(transfer.chunks) != header.num_chunks:
                    await fail(grpc.StatusCode.DATA_LOSS, "commit before every chunk arrived")
                transfer.commit = message.commit
                if self.refuse_commit is not None:
                    await fail(*self.refuse_commit)
                await self.hold_ack.wait()
                transfer.status = "ok"
                return kv_pb2.TransferKvResponse(
                    num_blocks=-(-header.num_tokens // self.layout.block_size),
                    num_bytes=num_bytes,
                )
            if kind == "abort":  # the sender gave up on purpose: its status ends the call
                code = _CODES[message.abort.code]
                transfer.status = f"aborted: {code.name}"
                self.reservations.pop(header.request_id, None)
                await _abort(context, code, message.abort.message)
            if kind != "chunk":
                await fail(grpc.StatusCode.DATA_LOSS, f"unexpected {kind} message")
            chunk = message.chunk
            arrival = Arrival(
                chunk.seq, chunk.layer, list(chunk.block_ids), len(chunk.data), time.perf_counter()
            )
            if chunk.seq != len(transfer.chunks) or chunk.request_id != header.request_id:
                await fail(grpc.StatusCode.DATA_LOSS, f"chunk {chunk.seq} out of order")
            if not self.reserve_any and not set(chunk.block_ids) <= set(block_ids):
                await fail(grpc.StatusCode.DATA_LOSS, f"blocks {chunk.block_ids} not reserved")
            if self.corrupt_seq == chunk.seq:
                chunk.data = bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:]
            if self.validate:
                from mili.kv_handoff.codec import decode_chunk

                try:
                    k, v = decode_chunk(chunk, self.layout)
                except Exception as err:
                    await fail(grpc.StatusCode.DATA_LOSS, str(err))
                if self.cache is not None:
                    self.cache.scatter_blocks(chunk.layer, list(chunk.block_ids), k, v)
            num_bytes += len(chunk.data)
            transfer.chunks.append(arrival)
            self.got_chunk.set()
            if self.on_chunk is not None:
                self.on_chunk(arrival)
            if self.stall_after is not None and len(transfer.chunks) >= self.stall_after:
                await self.resume.wait()
        await fail(grpc.StatusCode.DATA_LOSS, "stream ended without a commit")
        raise AssertionError("unreachable")


_CODES = {code.value[0]: code for code in grpc.StatusCode}


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """End the call as decode's server does (mili.rpc.interceptor): the status announced in the
    initial metadata too, where prefill finds it when a write of its raced the status."""
    await context.send_initial_metadata(status_header(code, message, ()))
    await context.abort(code, message)


@contextlib.asynccontextmanager
async def serve_receiver(receiver: KvReceiver, port: int = 0) -> AsyncIterator[grpc.aio.Server]:
    """`async with serve_receiver(r) as server:` -> server.address is host:port."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.so_reuseport", 0),
        ]
    )
    kv_pb2_grpc.add_KvTransferServiceServicer_to_server(receiver, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    server.address = f"127.0.0.1:{bound}"  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        await server.stop(None)


async def _main(layout_hex: str) -> None:
    receiver = KvReceiver(kv_pb2.KvLayout.FromString(bytes.fromhex(layout_hex)))
    receiver.reserve_any = True
    receiver.validate = False
    receiver.stall_after = 1
    receiver.on_chunk = lambda arrival: print(f"chunk {arrival.seq}", flush=True)
    async with serve_receiver(receiver) as server:
        print(f"receiver listening on {server.address}", flush=True)  # type: ignore[attr-defined]
        await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("layout_hex", help="serialized KvLayout, hex")
    asyncio.run(_main(parser.parse_args().layout_hex))
