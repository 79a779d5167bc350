"""What each method of a service accepts: how large a request message, and from whom.

A service states its rules once, when it is added to the server:

    server.add_service(DECODE_SERVICE, register, Policy(
        max_request_bytes={"Generate": ..., "GenerateStream": ...},  # others: SMALL_REQUEST_BYTES
        callers={"Generate": frontends, "GenerateStream": frontends},  # others: any caller
    ))

and the server's interceptor (mili.rpc.interceptor) enforces both before the servicer runs:

    caller  not one of the method's Callers (mili.discovery)  -> PERMISSION_DENIED, before any
            message of a request stream is read
    size    a request message over the method's limit         -> RESOURCE_EXHAUSTED, from its
            length: the deserializer gets the raw bytes, and refuses them unparsed

grpc has one receive limit per server, checked on a message's length prefix before the message
is read; the server sets it to the largest limit of its methods. So a service whose methods are
all small (tokenizer, prefill, the frontend) refuses an oversized request before reading it,
while a service with one large method (decode's TransferKv: megabytes of KV) reads the others'
oversized requests whole, never parses them, and gives the memory back (mili.rpc.heap).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from mili.discovery import Callers

# The longest request_id prefill and decode take (the frontend mints far shorter ones): a
# longer one is refused before it is looked up, logged or echoed.
MAX_REQUEST_ID_CHARS = 256

# Info, health, reflection, Pair: a few short fields.
SMALL_REQUEST_BYTES = 64 * 1024
# A request's fields besides its token and block ids: request ids, sampling (16 stop strings of
# 256 characters are 16 KB), a KV layout, trace context. Generous: it only has to be a bound.
REQUEST_FIELDS_BYTES = 256 * 1024

# The HTTP/2 receive window (per call, fixed: no bandwidth probe) of a service that receives no
# KV (tokenizer, prefill, the frontend): a request grpc refuses from its length prefix then
# leaves at most this much behind. With the probe the window grows to megabytes, and 16
# refused 60 MB requests left the tokenizer 136 MB larger; decode's TransferKv wants the probe.
SMALL_REQUESTS_WINDOW_BYTES = 1024 * 1024

# How many bytes of requests a caller of decode's GenerateStream puts in one message at most:
# more starts go in the next (a single start may be larger, up to Generate's limit). Decode's
# limit for GenerateStream messages follows from it; a frontend splits its writes by it.
GENERATE_STREAM_BATCH_BYTES = 1024 * 1024


def uint32s_bytes(count: int) -> int:
    """The largest encoding of `count` ids in a `repeated uint32` field: packed (as every proto3
    encoder writes it), varints of at most 5 bytes, plus the field's tag and length."""
    return 5 * count + 16


@dataclass(frozen=True)
class Policy:
    """One service's rules, by method name ("Generate"); see the module docstring."""

    # Largest request message of each method, in bytes (each message, for request streams).
    max_request_bytes: Mapping[str, int] = field(default_factory=dict)
    # Who may call each method; a method not named here takes any caller that reaches the port.
    callers: Mapping[str, Callers] = field(default_factory=dict)
    # The limit of the methods not in max_request_bytes; None: the server's receive limit.
    default_request_bytes: int | None = SMALL_REQUEST_BYTES

    def __post_init__(self) -> None:
        limits = [*self.max_request_bytes.values()]
        if self.default_request_bytes is not None:
            limits.append(self.default_request_bytes)
        if any(limit <= 0 for limit in limits):
            raise ValueError(
                f"request limits must be > 0, got {dict(self.max_request_bytes)} and "
                f"{self.default_request_bytes} for the others"
            )

    def request_bytes(self, method: str, server_limit: int) -> int:
        """The limit of `method` (a name, "Generate") on a server that receives `server_limit`."""
        limit = self.max_request_bytes.get(method, self.default_request_bytes)
        return server_limit if limit is None else min(limit, server_limit)

    def largest(self, server_limit: int) -> int:
        """The largest request any method of the service takes."""
        default = self.default_request_bytes or server_limit
        return min(max([default, *self.max_request_bytes.values()]), server_limit)


# A service without rules: any caller, requests up to the server's receive limit.
OPEN = Policy(default_request_bytes=None)
