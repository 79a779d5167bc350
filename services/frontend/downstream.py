"""A failed call to tokenizer, prefill or decode, turned into the error our caller should see.

The caller never talks to those services, so each message names the one that failed and where
("decode at 127.0.0.1:50054"); rich details (BadRequest, RetryInfo) are carried over.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from mili import errors
from mili.rpc.status import bad_request_of, retry_info_of
from services.frontend.calls import InstanceDown


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
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
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
    if code is grpc.StatusCode.UNAVAILABLE:  # down, draining, connection lost: route around it
        return InstanceDown(text)
    # CANCELLED (not by our caller: the peer went away), NOT_FOUND (a reservation vanished with
    # its peer), ABORTED...: retrying may work.
    return errors.Unavailable(text)


class DownstreamBug(Exception):
    """A downstream service failed with INTERNAL/UNKNOWN: a bug there, INTERNAL here too."""


def _rename(field: str, renames: Mapping[str, str]) -> str:
    """Rename the first component: "text" -> "prompt", "text[3]" -> "prompt[3]"."""
    cut = min((i for i in (field.find("."), field.find("[")) if i >= 0), default=len(field))
    head = field[:cut]
    return renames.get(head, head) + field[cut:]
