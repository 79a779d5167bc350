"""Exceptions -> gRPC statuses with `google.rpc` details, and the client-side readers of them.

Server side, `status_of` turns any exception a servicer raised into a `grpc.Status` whose
trailing metadata carries a serialized `google.rpc.Status` in `grpc-status-details-bin` (the
standard place every gRPC language reads rich errors from). Client side, `details_of`,
`bad_request_of` and `retry_info_of` read them back from a failed call.

A call whose client streams requests (TransferKv, DetokenizeStream) can lose the server's
status on the client: a write that races the status fails, and grpc.aio then sets the call's
status to INTERNAL "Internal error from Core" (trailers and all), also over the server's status
when that had already arrived. Initial metadata is another matter: grpc.aio keeps the first it
gets, and the server's goes out before its trailers, so it is in before the write that fails
on them (tests/rpc/test_rpc_status.py races such writes). So such a call that fails sends its
status twice:

    server   initial metadata  mili-status-bin: google.rpc.Status  (`status_header`)
             trailers          grpc-status, grpc-message, grpc-status-details-bin
    client   `server_status_of(err)`: err's own status, unless it is INTERNAL while the initial
             metadata says the server ended the call otherwise

    InvalidArgument    -> INVALID_ARGUMENT    + BadRequest (one FieldViolation per violation)
    NotFound           -> NOT_FOUND
    FailedPrecondition -> FAILED_PRECONDITION
    ResourceExhausted  -> RESOURCE_EXHAUSTED  + RetryInfo when retry_after_s is set
    Unavailable        -> UNAVAILABLE
    PeerUnavailable    -> UNAVAILABLE         + ErrorInfo(reason PEER_UNAVAILABLE, peer=address)
    DeadlineExceeded   -> DEADLINE_EXCEEDED
    Cancelled          -> CANCELLED
    DataLoss           -> DATA_LOSS
    NotImplementedError-> UNIMPLEMENTED       (what generated servicer stubs raise)
    anything else      -> INTERNAL, naming the method and exception type
"""

from __future__ import annotations

from typing import Any, NamedTuple

import grpc
from google.protobuf import any_pb2, descriptor_pool, message, message_factory
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from mili import errors

DETAILS_KEY = "grpc-status-details-bin"
STATUS_HEADER_KEY = "mili-status-bin"  # initial metadata: the status, as DETAILS_KEY carries it

# Status text travels twice in the trailers (grpc-message and inside grpc-status-details-bin) and
# clients refuse trailers over 8 KiB by default, so an oversized exception text would turn a
# clear error into an opaque "metadata too large". Keep both well under that.
# google.rpc.ErrorInfo of a PeerUnavailable: the domain names MILI, the reason the case.
ERROR_DOMAIN = "mili"
PEER_UNAVAILABLE = "PEER_UNAVAILABLE"
_MAX_MESSAGE_CHARS = 1500
_MAX_VIOLATIONS = 16
_MAX_DESCRIPTION_CHARS = 200

_CODES: tuple[tuple[type[errors.MiliError], grpc.StatusCode], ...] = (
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Cancelled, grpc.StatusCode.CANCELLED),
    (errors.DataLoss, grpc.StatusCode.DATA_LOSS),
)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def code_of(exc: BaseException) -> grpc.StatusCode:
    """The status code `exc` maps to; INTERNAL for anything that is not a known domain error."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    return grpc.StatusCode.INTERNAL


def is_internal(exc: BaseException) -> bool:
    """True when `exc` is a bug (INTERNAL) rather than an error meant for the caller."""
    return code_of(exc) is grpc.StatusCode.INTERNAL


def _describe(exc: BaseException) -> str:
    """`ValueError: boom`; a downstream gRPC failure shows its code and details, not a repr."""
    if isinstance(exc, grpc.RpcError):
        code, details = code_and_details(exc)
        return f"{type(exc).__name__}: {code.name}: {details}"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _message(exc: BaseException, code: grpc.StatusCode, method: str) -> str:
    if code is grpc.StatusCode.INTERNAL:
        return f"internal error in {method}: {_clip(_describe(exc), 1000)}; see server log"
    if code is grpc.StatusCode.UNIMPLEMENTED:
        return f"{method} is not implemented" + (f": {exc}" if str(exc) else "")
    return str(exc) or code.name.lower().replace("_", " ")


def _details(exc: BaseException) -> list[message.Message]:
    if isinstance(exc, errors.InvalidArgument):
        violations = [
            error_details_pb2.BadRequest.FieldViolation(
                field=v.field, description=_clip(v.description, _MAX_DESCRIPTION_CHARS)
            )
            for v in exc.violations[:_MAX_VIOLATIONS]
        ]
        return [error_details_pb2.BadRequest(field_violations=violations)]
    if isinstance(exc, errors.ResourceExhausted) and exc.retry_after_s is not None:
        info = error_details_pb2.RetryInfo()
        info.retry_delay.FromNanoseconds(round(max(0.0, exc.retry_after_s) * 1e9))
        return [info]
    if isinstance(exc, errors.PeerUnavailable):
        return [
            error_details_pb2.ErrorInfo(
                reason=PEER_UNAVAILABLE, domain=ERROR_DOMAIN, metadata={"peer": exc.peer}
            )
        ]
    return []


def status_of(exc: BaseException, method: str) -> grpc.Status:
    """The status a call to `method` (e.g. `/pkg.Service/Method`) ends with when it raised `exc`.

    The result is ready for `context.abort(status.code, status.details, status.trailing_metadata)`.
    """
    code = code_of(exc)
    proto = status_pb2.Status(
        code=code.value[0], message=_clip(_message(exc, code, method), _MAX_MESSAGE_CHARS)
    )
    for detail in _details(exc):
        proto.details.add().Pack(detail)
    status: grpc.Status = rpc_status.to_status(proto)
    return status


def status_header(
    code: grpc.StatusCode, details: str, trailing_metadata: Any
) -> tuple[tuple[str, bytes]]:
    """Initial metadata announcing the status a call is about to end with (see the top).

    The google.rpc.Status of `trailing_metadata` when it carries one (details included), else
    one made of `code` and `details`.
    """
    for key, value in trailing_metadata or ():
        if key == DETAILS_KEY:
            return ((STATUS_HEADER_KEY, bytes(value)),)
    proto = status_pb2.Status(code=code.value[0], message=details)
    return ((STATUS_HEADER_KEY, proto.SerializeToString()),)


# ---- client side ------------------------------------------------------------------------------


def code_and_details(err: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """A failed call's code and details; UNKNOWN and the error's text for a hand-made RpcError,
    which need not be a Call."""
    if not callable(getattr(err, "code", None)):
        return grpc.StatusCode.UNKNOWN, str(err)
    return err.code(), err.details() or ""


def _status_proto(err: grpc.RpcError) -> status_pb2.Status | None:
    """The `google.rpc.Status` a failed call carries, or None when it has none (or a stale one)."""
    # Every RpcError raised by a call is also a Call; a hand-made RpcError may not be.
    has_trailers = callable(getattr(err, "trailing_metadata", None))
    trailing: Any = err.trailing_metadata() if has_trailers else None
    for key, value in trailing or ():
        if key == DETAILS_KEY:
            proto = status_pb2.Status.FromString(value)
            # A proxy may rewrite the status but forward trailers; details of another code lie.
            if proto.code != err.code().value[0]:
                return None
            return proto
    return None


class CallStatus(NamedTuple):
    """How the server ended a call (see `server_status_of`)."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...]  # with DETAILS_KEY when it sent one


_GRPC_CODES = {code.value[0]: code for code in grpc.StatusCode}


def server_status_of(err: grpc.RpcError) -> CallStatus:
    """The status the server ended the call with: `err`'s own, unless grpc replaced it by INTERNAL
    after a write raced it and the server announced another one in its initial metadata."""
    code: grpc.StatusCode = err.code()
    trailing = err.trailing_metadata() if callable(getattr(err, "trailing_metadata", None)) else ()
    own = CallStatus(code, err.details() or "", tuple(trailing or ()))
    if code is not grpc.StatusCode.INTERNAL or not callable(getattr(err, "initial_metadata", None)):
        return own
    for key, value in err.initial_metadata() or ():
        if key == STATUS_HEADER_KEY:
            announced = status_pb2.Status.FromString(value)
            if announced.code == code.value[0]:
                return own  # the server's own INTERNAL: its trailers are the ones that count
            return CallStatus(
                _GRPC_CODES.get(announced.code, grpc.StatusCode.UNKNOWN),
                announced.message,
                ((DETAILS_KEY, bytes(value)),),
            )
    return own


def _unpack(packed: any_pb2.Any) -> message.Message:
    """The typed message inside `packed`; the Any itself when its type is not linked in."""
    try:
        descriptor = descriptor_pool.Default().FindMessageTypeByName(packed.TypeName())
    except KeyError:
        return packed
    unpacked: message.Message = message_factory.GetMessageClass(descriptor)()
    packed.Unpack(unpacked)
    return unpacked


def details_of(err: grpc.RpcError) -> list[message.Message]:
    """The `google.rpc` detail messages (BadRequest, RetryInfo, ...) of a failed call, in order.

    Works for `grpc.aio.AioRpcError` and the sync `grpc.RpcError`; [] when there are none.
    """
    proto = _status_proto(err)
    return [] if proto is None else [_unpack(packed) for packed in proto.details]


def bad_request_of(err: grpc.RpcError) -> error_details_pb2.BadRequest | None:
    """The BadRequest detail of an INVALID_ARGUMENT failure (one entry per bad field), if any."""
    found = [d for d in details_of(err) if isinstance(d, error_details_pb2.BadRequest)]
    return found[0] if found else None


def unavailable_peer_of(err: grpc.RpcError) -> str | None:
    """The peer an UNAVAILABLE failure blames (ErrorInfo PEER_UNAVAILABLE), or None when the
    instance called is the one unavailable (or did not say)."""
    for detail in details_of(err):
        if (
            isinstance(detail, error_details_pb2.ErrorInfo)
            and detail.reason == PEER_UNAVAILABLE
            and detail.domain == ERROR_DOMAIN
        ):
            return detail.metadata.get("peer", "")
    return None


def retry_info_of(err: grpc.RpcError) -> error_details_pb2.RetryInfo | None:
    """The RetryInfo detail (how long to back off) of a RESOURCE_EXHAUSTED failure, if any."""
    found = [d for d in details_of(err) if isinstance(d, error_details_pb2.RetryInfo)]
    return found[0] if found else None
