"""Requests refused before they are parsed, by the server interceptor: messages over their
method's size limit (RESOURCE_EXHAUSTED) and bytes that do not parse (INVALID_ARGUMENT).

grpc.aio deserializes a unary request before the handler runs, and each message of a streamed
request inside the handler's reads. Left alone, a DecodeError there escapes to grpc itself,
which answers UNKNOWN and logs a full traceback at ERROR for every such call (a log flood
anyone can cause), past our error mapping and metrics; and a message of tens of MB under grpc's
server-wide limit would be parsed into millions of objects before any length is checked. So
the interceptor installs `guard(deserializer, max_bytes)` on every method it wraps: a message
longer than the method's limit becomes an `Oversized` (its bytes are never parsed), a
DecodeError a `Malformed`, in place of the message; the interceptor then ends the call with
RESOURCE_EXHAUSTED "request to /pkg.Service/Method is N bytes, over its limit of M" or
INVALID_ARGUMENT "malformed request to /pkg.Service/Method: ...", and one WARNING line:

    unary request      the handler's request is a Refused: refused before the servicer runs
    streamed requests  `CheckedRequests` wraps the request iterator: reading a Refused ends
                       the call right there (status sent) and raises grpc's AbortError into
                       the servicer, whatever it then makes of it

A servicer reading with `context.read()` instead of iterating would see the Refused itself;
no MILI servicer does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from google.protobuf.message import DecodeError

from mili.rpc import heap

Deserializer = Callable[[bytes], Any]


@dataclass(frozen=True)
class Malformed:
    """Stands in for a request message whose bytes did not parse."""

    # The parser's words, e.g. "Error parsing message with type 'mili.tokenizer.v1.
    # TokenizeRequest': Wire format was corrupt"; they never quote the bytes themselves.
    reason: str


@dataclass(frozen=True)
class Oversized:
    """Stands in for a request message longer than its method's limit (never parsed)."""

    num_bytes: int
    max_bytes: int


Refused = Malformed | Oversized


def guard(
    deserializer: Deserializer | None, max_bytes: int, *, is_request_streaming: bool = False
) -> Deserializer:
    """`deserializer` (None: raw bytes), returning an Oversized for a message longer than
    `max_bytes` and a Malformed where it raises DecodeError (what protobuf's FromString raises,
    and mili.kv_handoff.codec.parse_transfer_request by way of it). Any other exception is a bug
    in a custom deserializer and stays loud. The buffers of an oversized message, and of a large
    unary one, go back to the OS once their burst is over (mili.rpc.heap)."""

    def deserialize(raw: bytes) -> Any:
        num_bytes = len(raw)
        if num_bytes > max_bytes:
            heap.release_soon()
            return Oversized(num_bytes, max_bytes)
        if num_bytes >= heap.LARGE_REQUEST_BYTES and not is_request_streaming:
            heap.release_soon()
        if deserializer is None:
            return raw
        try:
            return deserializer(raw)
        except DecodeError as exc:
            return Malformed(str(exc))

    return deserialize


Refuse = Callable[[Refused], Awaitable[NoReturn]]


class CheckedRequests:
    """A streamed call's request iterator that ends the call, through `refuse` (which aborts
    it), at the first Malformed or Oversized message."""

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
        if isinstance(request, Malformed | Oversized):
            try:
                await self._refuse(request)
            except BaseException as exc:
                self.abort = exc
                raise
        return request
