"""A failed call to tokenizer, prefill or decode, turned into the error our caller should see.

The caller never talks to those services, so each message names the one that failed and where
("decode at 127.0.0.1:50054"); rich details (BadRequest, RetryInfo) are carried over. An error
about the request's own field (a violation named in BadRequest, a constraint too complex for
the grammar engine) is the same on any instance: its message comes as it is, without them.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from mili import errors
from mili.rpc.status import (
    DETAILS_KEY,
    bad_request_of,
    code_and_details,
    retry_info_of,
    unavailable_peer_of,
)
from services.frontend.calls import InstanceDown

# How prefill's and decode's messages about a request's field begin ("sampling.grammar: ...").
_REQUEST_FIELDS = "sampling."


def error_from(
    err: grpc.RpcError,
    who: str,
    *,
    field_names: Mapping[str, str] | None = None,
    is_own_deadline_passed: bool = False,
) -> Exception:
    """The domain error for `err`, a failed call to `who` (e.g. "prefill at HOST:PORT").

    `field_names` renames the downstream's BadRequest fields to ours (tokenizer "text" is our
    "prompt"). DEADLINE_EXCEEDED is ours only when our caller's deadline passed; otherwise a
    downstream timeout (a KV lease running out) means a peer is stuck: UNAVAILABLE.
    """
    code, details = code_and_details(err)
    text = f"{who}: {code.name}: {details}"
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        bad = bad_request_of(err)
        if bad is not None and bad.field_violations:
            renames = field_names or {}
            return errors.InvalidArgument.many(
                [
                    errors.FieldViolation(_rename(v.field, renames), v.description)
                    for v in bad.field_violations
                ]
            )
        return errors.InvalidArgument.many([errors.FieldViolation("", text)])
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        info = retry_info_of(err)
        if info is None and details.startswith(_REQUEST_FIELDS):
            # a limit of what the request asks (mili.engine.constraint.matcher.too_complex),
            # not of the instance's capacity, which comes with a retry hint
            return errors.ResourceExhausted(details)
        retry = None if info is None else info.retry_delay.ToNanoseconds() / 1e9
        return errors.ResourceExhausted(text, retry_after_s=retry)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        if is_own_deadline_passed:
            return errors.DeadlineExceeded(text)
        return errors.Unavailable(f"{text} (a peer did not answer in time)")
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return errors.FailedPrecondition(text)
    if code is grpc.StatusCode.DATA_LOSS:
        return errors.DataLoss(text)
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED):
        return DownstreamBug(text)
    if code is grpc.StatusCode.UNAVAILABLE:
        peer = unavailable_peer_of(err)
        if peer is not None:
            # The instance is fine; one it called for this request is not (prefill's KV
            # destination went away): retry, but keep routing to the instance.
            return errors.PeerUnavailable(text, peer=peer)
        return InstanceDown(text)  # down, draining, connection lost: route around it
    # CANCELLED (not by our caller: the peer went away), NOT_FOUND (a reservation vanished with
    # its peer), ABORTED...: retrying may work.
    return errors.Unavailable(text)


def error_from_status(
    code: grpc.StatusCode,
    message: str,
    status_details: bytes,
    who: str,
    *,
    is_own_deadline_passed: bool = False,
) -> Exception:
    """`error_from` for a status carried in a message rather than ending a call: a request's
    error on decode's GenerateStream (`status_details`: its serialized google.rpc.Status)."""
    carried = _CarriedStatus(code, message, status_details)
    return error_from(carried, who, is_own_deadline_passed=is_own_deadline_passed)


class _CarriedStatus(grpc.RpcError):
    """A status read from a message, shaped as the failed call `error_from` reads."""

    def __init__(self, code: grpc.StatusCode, message: str, status_details: bytes) -> None:
        self._code = code
        self._message = message
        self._trailers = ((DETAILS_KEY, status_details),) if status_details else ()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self._trailers


class DownstreamBug(Exception):
    """A downstream service failed with INTERNAL/UNKNOWN: a bug there, INTERNAL here too."""


def _rename(field: str, renames: Mapping[str, str]) -> str:
    """Rename the first component: "text" -> "prompt", "text[3]" -> "prompt[3]"."""
    cut = min((i for i in (field.find("."), field.find("[")) if i >= 0), default=len(field))
    head = field[:cut]
    return renames.get(head, head) + field[cut:]
