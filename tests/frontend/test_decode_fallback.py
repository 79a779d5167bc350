"""A decode instance that does not serve GenerateStream (older than it): the requests a
DecodeMultiplexer opened on it move to Generate calls of their own, and so do later ones,
whether grpc reports decode's UNIMPLEMENTED or hides it behind INTERNAL because a start was
being written as decode refused the call (which happens about every other time)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from mili.decode.v1 import decode_pb2, decode_pb2_grpc
from mili.engine.stop import FinishReason
from services.frontend.calls import Admitted, Deadline, Tokens
from services.frontend.generate_call import GenerateCall
from services.frontend.multiplex import DecodeMultiplexer
from tests.frontend.fakes import FakeDecode, ids

_DECODE = "mili.decode.v1.DecodeService"


async def _read_all(stream: object) -> list[Admitted | Tokens]:
    events = []
    while (event := await stream.read()) is not None:  # type: ignore[attr-defined]
        events.append(event)
    return events


def test_requests_move_to_generate_calls_on_a_decode_without_generate_stream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        decode = FakeDecode(script=[ids("ab"), ids("c")])
        decode.kv_landed.set()  # no prefill here: tokens at once
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                decode.Generate,
                request_deserializer=decode_pb2.GenerateRequest.FromString,
                response_serializer=decode_pb2.GenerateResponse.SerializeToString,
            )
        }
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_DECODE, handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            for attempt in range(12):  # a fresh multiplexer each time: the first call races
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = decode_pb2_grpc.DecodeServiceStub(channel)
                    mux = DecodeMultiplexer(stub, "decode at test")
                    first = []
                    for i in range(4):  # several writes, as requests come one by one
                        request = decode_pb2.GenerateRequest(request_id=f"r{attempt}-{i}")
                        first.append(mux.open(request, Deadline(30)))
                        await asyncio.sleep(0)
                    for stream in first:
                        events = await _read_all(stream)
                        assert isinstance(events[0], Admitted)
                        tokens = [e for e in events[1:] if isinstance(e, Tokens)]
                        assert [t for e in tokens for t in e.token_ids] == ids("abc")
                        assert tokens[-1].finish_reason is FinishReason.LENGTH
                    later = mux.open(
                        decode_pb2.GenerateRequest(request_id=f"r{attempt}-x"), Deadline(30)
                    )
                    assert isinstance(later, GenerateCall)
                    assert isinstance((await _read_all(later))[0], Admitted)
                    await mux.close()
        finally:
            await server.stop(None)
        refused = [r for r in caplog.records if "does not serve GenerateStream" in r.getMessage()]
        assert len(refused) == 12  # once per multiplexer, not per request

    with caplog.at_level(logging.WARNING, logger="mili.frontend"):
        asyncio.run(main())


class _Upgradable(grpc.GenericRpcHandler):
    """Serves Generate always and GenerateStream once `serves_stream` is set: an older decode
    replaced by a newer one at the same address."""

    def __init__(self, decode: FakeDecode) -> None:
        self.serves_stream = False
        self._generate = grpc.unary_stream_rpc_method_handler(
            decode.Generate,
            request_deserializer=decode_pb2.GenerateRequest.FromString,
            response_serializer=decode_pb2.GenerateResponse.SerializeToString,
        )
        self._stream = grpc.stream_stream_rpc_method_handler(
            decode.GenerateStream,
            request_deserializer=decode_pb2.GenerateStreamRequest.FromString,
            response_serializer=decode_pb2.GenerateStreamResponse.SerializeToString,
        )

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method == f"/{_DECODE}/Generate":
            return self._generate
        if details.method == f"/{_DECODE}/GenerateStream" and self.serves_stream:
            return self._stream
        return None  # UNIMPLEMENTED


def test_a_refusal_is_rechecked_so_an_upgraded_decode_gets_generate_stream_again() -> None:
    async def main() -> None:
        decode = FakeDecode(script=[ids("ab"), ids("c")])
        decode.kv_landed.set()
        handler = _Upgradable(decode)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        now = [100.0]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = decode_pb2_grpc.DecodeServiceStub(channel)
                mux = DecodeMultiplexer(stub, "decode at test", recheck_s=30, clock=lambda: now[0])
                first = mux.open(decode_pb2.GenerateRequest(request_id="old-1"), Deadline(30))
                assert [t for e in await _read_all(first) if isinstance(e, Tokens)
                        for t in e.token_ids] == ids("abc")  # fmt: skip
                later = mux.open(decode_pb2.GenerateRequest(request_id="old-2"), Deadline(30))
                assert isinstance(later, GenerateCall)  # the refusal is believed...
                await _read_all(later)
                handler.serves_stream = True  # decode is replaced by one that serves it
                now[0] += 29
                still = mux.open(decode_pb2.GenerateRequest(request_id="old-3"), Deadline(30))
                assert isinstance(still, GenerateCall)
                await _read_all(still)
                now[0] += 2  # ...for recheck_s: then the next request asks again
                upgraded = mux.open(decode_pb2.GenerateRequest(request_id="new-1"), Deadline(30))
                assert not isinstance(upgraded, GenerateCall)
                events = await _read_all(upgraded)
                assert isinstance(events[0], Admitted)
                assert [t for e in events[1:] if isinstance(e, Tokens)
                        for t in e.token_ids] == ids("abc")  # fmt: skip
                again = mux.open(decode_pb2.GenerateRequest(request_id="new-2"), Deadline(30))
                assert not isinstance(again, GenerateCall)
                await _read_all(again)
                await mux.close()
        finally:
            await server.stop(None)

    asyncio.run(main())
