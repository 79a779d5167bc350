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
