"""A frontend's GenerateStream writes stay within decode's limit for one message: the starts
and cancels queued since the last write go out in order, in messages of at most
GENERATE_STREAM_BATCH_BYTES (a start larger than that alone)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from mili.pb.decode.v1 import decode_pb2, decode_pb2_grpc
from mili.rpc.client import insecure_channel
from mili.rpc.policy import GENERATE_STREAM_BATCH_BYTES
from mili.rpc.server import RpcServer
from mili.rpc.server_config import ServerConfig
from services.frontend.calls import MAX_DOWNSTREAM_TIMEOUT_S, Deadline
from services.frontend.multiplex import DecodeMultiplexer, _messages
from tests.frontend.fakes import FakeDecode


def _start(request_id: str, num_ids: int) -> decode_pb2.StreamedGenerate:
    request = decode_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=[100_000] * num_ids
    )
    return decode_pb2.StreamedGenerate(request=request, timeout_ms=1000)


def test_a_usual_write_is_one_message() -> None:
    starts = [_start(f"r{i}", 128) for i in range(64)]
    (message,) = _messages(starts, ["r0", "x"])
    assert list(message.starts) == starts and list(message.cancel_request_ids) == ["r0", "x"]


def test_large_writes_are_split_in_order_within_the_limit() -> None:
    starts = [_start(f"r{i}", 100_000) for i in range(8)]  # ~300 KB each
    starts.insert(3, _start("alone", 400_000))  # larger than the limit: a message of its own
    cancels = [f"c{i}" for i in range(1000)]
    messages = _messages(starts, cancels)
    assert [s for m in messages for s in m.starts] == starts
    assert [c for m in messages for c in m.cancel_request_ids] == cancels
    for m in messages:
        assert m.ByteSize() <= GENERATE_STREAM_BATCH_BYTES or len(m.starts) == 1, m.ByteSize()
    assert [len(m.starts) for m in messages] == [3, 1, 3, 2]


@contextlib.asynccontextmanager
async def _multiplexer(decode: FakeDecode) -> AsyncIterator[DecodeMultiplexer]:
    """A multiplexer over a real GenerateStream to `decode`, served on 127.0.0.1."""
    server = RpcServer(ServerConfig(drain_timeout_s=1.0, grace_s=0.1), name="decode")
    server.add_service(
        "mili.decode.v1.DecodeService",
        lambda s: decode_pb2_grpc.add_DecodeServiceServicer_to_server(decode, s),
    )
    port = await server.start()
    channel = insecure_channel(f"127.0.0.1:{port}")
    mux = DecodeMultiplexer(decode_pb2_grpc.DecodeServiceStub(channel), "decode at fake")
    try:
        yield mux
    finally:
        await mux.close()
        await channel.close()
        await server.drain()


def test_a_request_cancelled_before_its_start_went_out_never_reaches_decode() -> None:
    """Found by a read-only review: a request cancelled (its caller gone, its admission timed
    out) before the writer sent its start still had the start sent, then a cancel: decode
    admitted it, reserved its blocks and compiled its constraint for nothing."""

    async def main() -> None:
        decode = FakeDecode()
        async with _multiplexer(decode) as mux:
            gone = mux.open(decode_pb2.GenerateRequest(request_id="gone"), Deadline(5.0))
            gone.cancel("the caller left")  # before the writer ran: its start is still queued
            session = mux._session
            assert session is not None and (session._starts, session._cancels) == ([], [])
            kept = mux.open(decode_pb2.GenerateRequest(request_id="kept"), Deadline(5.0))
            assert await asyncio.wait_for(kept.read(), 5) is not None  # admitted
            kept.cancel("the caller left")
            await asyncio.sleep(0.1)
            assert [r.request_id for r in decode.requests] == ["kept"]

    asyncio.run(main())


def test_a_deadline_past_what_timeout_ms_holds_is_sent_as_its_largest() -> None:
    """Found by a review: a caller's timeout of 5e6 s (58 days) overflowed the uint32
    timeout_ms: every such request failed INTERNAL, and left its stream registered."""

    async def main() -> None:
        decode = FakeDecode()
        async with _multiplexer(decode) as mux:
            far = mux.open(decode_pb2.GenerateRequest(request_id="far"), Deadline(5e6))
            session = mux._session
            assert session is not None
            (start,) = session._starts
            assert start.timeout_ms == MAX_DOWNSTREAM_TIMEOUT_S * 1000 <= 2**32 - 1
            assert await asyncio.wait_for(far.read(), 5) is not None  # admitted
            far.cancel("the caller left")

    asyncio.run(main())
