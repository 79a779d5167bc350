"""Domain errors raised anywhere in MILI, mapped to gRPC status codes at the transport edge.

Pure Python on purpose: engine and bookkeeping code raise these without importing grpc; the
server interceptor in `mili.rpc` turns each into its status code, message and `google.rpc`
details (BadRequest field violations, RetryInfo).
"""

from __future__ import annotations

from dataclasses import dataclass

from mili.plural import plural


class MiliError(Exception):
    """Base of every error a caller should see as a gRPC status other than INTERNAL."""


@dataclass(frozen=True)
class FieldViolation:
    """One bad field of a request: `field` is a dotted path (e.g. `sampling.top_p`)."""

    field: str
    description: str

    @classmethod
    def of(cls, field: str, value: object, reason: str) -> FieldViolation:
        """`field` refused for `reason`, quoting the (shortened) value it had."""
        return cls(field, f"{reason} (got {_show(value)})")


def count_of(num: int, noun: str) -> object:
    """What a value too large to quote is said as, its size: quoted as `got 3000000 tokens`,
    not as a string `'3000000 tokens'` the caller never sent."""
    return _Count(plural(num, noun))


class _Count(str):
    """A count_of: shown as it is where a value is quoted."""


def _show(value: object, limit: int = 80) -> str:
    text = value if isinstance(value, _Count) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class InvalidArgument(MiliError):
    """The request itself is wrong (INVALID_ARGUMENT); each violation names its field."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        violation = FieldViolation.of(field, value, reason)
        self.violations = [violation]
        super().__init__(f"{field}: {violation.description}")

    @classmethod
    def many(cls, violations: list[FieldViolation]) -> InvalidArgument:
        """One error carrying several field violations."""
        err = cls.__new__(cls)
        err.violations = list(violations)
        MiliError.__init__(err, "; ".join(f"{v.field}: {v.description}" for v in violations))
        return err


class PermissionDenied(MiliError):
    """The caller may not do this, e.g. send KV without the request's transfer token, or ask
    prefill to send KV to an address it may not talk to (PERMISSION_DENIED)."""


class NotFound(MiliError):
    """A named entity (request id, model) does not exist (NOT_FOUND)."""


class FailedPrecondition(MiliError):
    """The system is not in a state to do this, e.g. KV layouts differ (FAILED_PRECONDITION)."""


class ResourceExhausted(MiliError):
    """Out of capacity right now (RESOURCE_EXHAUSTED); `retry_after_s` hints when to retry."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(MiliError):
    """A service we depend on is down or draining (UNAVAILABLE); safe to retry elsewhere."""


class PeerUnavailable(Unavailable):
    """UNAVAILABLE because an instance this one called on the request's behalf (`peer`, e.g.
    the decode instance prefill sends KV to) is down or went away, not this one: callers keep
    routing to us (the status carries ErrorInfo reason PEER_UNAVAILABLE naming the peer)."""

    def __init__(self, message: str, peer: str) -> None:
        super().__init__(message)
        self.peer = peer


class DeadlineExceeded(MiliError):
    """The request's deadline passed before it finished (DEADLINE_EXCEEDED)."""


class Cancelled(MiliError):
    """The request was cancelled by its caller (CANCELLED)."""


class DataLoss(MiliError):
    """Bytes arrived corrupt, short or out of order, e.g. a KV chunk's checksum (DATA_LOSS)."""


class StartupError(Exception):
    """A service cannot start (bad model directory, bad flag). The CLI prints the message as one
    line and exits non-zero, without a traceback: the message must say what is wrong and where."""
