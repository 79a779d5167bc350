"""One request on a Generate call of its own: the decode path for an instance that does not serve
GenerateStream (an older one answers UNIMPLEMENTED; multiplex.py falls back to this)."""

from __future__ import annotations

from typing import Any

import grpc

from mili.decode.v1 import decode_pb2, decode_pb2_grpc
from services.frontend import convert
from services.frontend.calls import Admitted, Deadline, Tokens
from services.frontend.downstream import error_from


class GenerateCall:
    """decode's Generate call as `calls.DecodeStream`: one message per event, its own status."""

    def __init__(
        self,
        stub: decode_pb2_grpc.DecodeServiceStub,
        request: decode_pb2.GenerateRequest,
        deadline: Deadline,
        who: str,
    ) -> None:
        self._call: Any = stub.Generate(request, timeout=deadline.remaining())
        self._deadline = deadline
        self._who = who  # "decode at HOST:PORT"

    async def read(self) -> Admitted | Tokens | None:
        while True:
            try:
                event = await self._call.read()
            except grpc.aio.AioRpcError as err:
                raise error_from(
                    err, self._who, is_own_deadline_passed=self._deadline.has_passed
                ) from None
            if event is grpc.aio.EOF:
                return None
            converted = convert.decode_event(event)
            if converted is not None:  # skip an event kind this version does not know
                return converted

    def cancel(self) -> None:
        self._call.cancel()
