"""Requests whose bytes do not parse, refused as INVALID_ARGUMENT by the server interceptor.

grpc.aio deserializes a unary request before the handler runs, and each message of a streamed
request inside the handler's reads. Left alone, a DecodeError there escapes to grpc itself,
which answers UNKNOWN and logs a full traceback at ERROR for every such call (a log flood
anyone can cause), past our error mapping and metrics. So the interceptor installs
`guard(deserializer)` on every method it wraps: a DecodeError becomes a `Malformed` value in
place of the message, and the interceptor ends the call with INVALID_ARGUMENT
"malformed request to /pkg.Service/Method: ..." and one WARNING line:

    unary request      the handler's request is a Malformed: refused before the servicer runs
    streamed requests  `CheckedRequests` wraps the request iterator: reading a Malformed ends
                       the call right there (status sent) and raises grpc's AbortError into
                       the servicer, whatever it then makes of it

A servicer reading with `context.read()` instead of iterating would see the Malformed itself;
no MILI servicer does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from google.protobuf.message import DecodeError

Deserializer = Callable[[bytes], Any]


@dataclass(frozen=True)
class Malformed:
    """Stands in for a request message whose bytes did not parse."""

    # The parser's words, e.g. "Error parsing message with type 'mili.tokenizer.v1.
    # TokenizeRequest': Wire format was corrupt"; they never quote the bytes themselves.
    reason: str


def guard(deserializer: Deserializer | None) -> Deserializer | None:
    """`deserializer`, returning a Malformed where it raises DecodeError (what protobuf's
    FromString raises, and mili.kv_handoff.codec.parse_transfer_request by way of it). Any other
    exception is a bug in a custom deserializer and stays loud. None (raw bytes) stays None."""
    if deserializer is None:
        return None

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except DecodeError as exc:
            return Malformed(str(exc))

    return deserialize


Refuse = Callable[[Malformed], Awaitable[NoReturn]]


class CheckedRequests:
    """A streamed call's request iterator that ends the call, through `refuse` (which aborts
    it), at the first Malformed message."""

    def __init__(self, requests: AsyncIterator[Any], refuse: Refuse) -> None:
        self._requests = aiter(requests)
        self._refuse = refuse
        # The AbortError raised into the servicer: the interceptor re-raises this very object
        # (grpc checks that) if the servicer turned it into another exception.
        self.abort: BaseException | None = None

    def __aiter__(self) -> CheckedRequests:
        return self

    async def __anext__(self) -> Any:
        if self.abort is not None:  # read again after the refusal: the call is over
            raise self.abort
        request = await anext(self._requests)
        if isinstance(request, Malformed):
            try:
                await self._refuse(request)
            except BaseException as exc:
                self.abort = exc
                raise
        return request
