"""Downstream failures become errors naming the service, with their details carried over."""

from __future__ import annotations

import grpc
import pytest

from mili import errors
from mili.engine.stop import FinishReason
from mili.rpc.status import status_of
from services.frontend.calls import InstanceDown
from services.frontend.downstream import DownstreamBug, error_from
from services.frontend.stop import clip_tokens

STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH


class FakeError(grpc.RpcError):
    """What a failed call raises, built from a server-side status (trailers included)."""

    def __init__(self, exc: BaseException) -> None:
        status = status_of(exc, "/x/Y")
        self._code, self._details, self._trailers = (
            status.code,
            status.details,
            status.trailing_metadata,
        )

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailers


def test_invalid_argument_keeps_violations_and_renames_fields() -> None:
    err = FakeError(
        errors.InvalidArgument.many(
            [
                errors.FieldViolation("text", "too long"),
                errors.FieldViolation("messages[2].role", "bad role"),
            ]
        )
    )
    mapped = error_from(err, "tokenizer at a:1", field_names={"text": "prompt"})
    assert isinstance(mapped, errors.InvalidArgument)
    assert [v.field for v in mapped.violations] == ["prompt", "messages[2].role"]


def test_resource_exhausted_keeps_retry_info() -> None:
    mapped = error_from(FakeError(errors.ResourceExhausted("full", 2.5)), "decode at d:1")
    assert isinstance(mapped, errors.ResourceExhausted)
    assert mapped.retry_after_s == pytest.approx(2.5)
    assert "decode at d:1" in str(mapped)


def test_a_limit_of_the_requests_own_field_comes_without_the_instance() -> None:
    """A constraint too complex for the grammar engine is so on any instance: the caller gets
    the field's message, not "prefill at HOST:PORT: RESOURCE_EXHAUSTED: sampling.grammar: ...".
    Capacity (a retry hint) and other codes still name the instance."""
    message = "sampling.grammar: the constraint is too complex (parser error: Too many items)"
    mapped = error_from(FakeError(errors.ResourceExhausted(message)), "prefill at p:1")
    assert isinstance(mapped, errors.ResourceExhausted) and mapped.retry_after_s is None
    assert str(mapped) == message
    busy = errors.ResourceExhausted("sampling.grammar: 4 constraints are compiling", 5.0)
    assert "prefill at p:1" in str(error_from(FakeError(busy), "prefill at p:1"))
    full = error_from(FakeError(errors.ResourceExhausted("queue full")), "prefill at p:1")
    assert "prefill at p:1" in str(full)


def test_deadline_is_ours_only_when_our_deadline_passed() -> None:
    err = FakeError(errors.DeadlineExceeded("lease ran out"))
    assert isinstance(error_from(err, "decode at d:1"), errors.Unavailable)
    mapped = error_from(err, "decode at d:1", is_own_deadline_passed=True)
    assert isinstance(mapped, errors.DeadlineExceeded)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (errors.Unavailable("draining"), errors.Unavailable),
        (errors.NotFound("no reservation"), errors.Unavailable),
        (errors.Cancelled("peer went away"), errors.Unavailable),
        (errors.FailedPrecondition("layouts differ"), errors.FailedPrecondition),
        (errors.DataLoss("crc"), errors.DataLoss),
        (RuntimeError("boom"), DownstreamBug),
    ],
)
def test_codes_map_and_name_the_service(exc: BaseException, expected: type) -> None:
    mapped = error_from(FakeError(exc), "prefill at p:1")
    assert isinstance(mapped, expected)
    assert "prefill at p:1" in str(mapped)


def test_unavailable_is_the_instance_down_unless_it_blames_a_peer() -> None:
    """Prefill answering UNAVAILABLE because its KV destination (decode) went away must not
    take prefill out of routing: only an UNAVAILABLE of its own does."""
    down = error_from(FakeError(errors.Unavailable("draining")), "prefill at p:1")
    assert isinstance(down, InstanceDown)
    peer = errors.PeerUnavailable("KV to decode at d:1 failed", peer="d:1")
    mapped = error_from(FakeError(peer), "prefill at p:1")
    assert isinstance(mapped, errors.Unavailable) and not isinstance(mapped, InstanceDown)
    assert "prefill at p:1" in str(mapped) and "d:1" in str(mapped)


def test_clip_tokens_stops_at_stop_ids_and_max_tokens() -> None:
    stops = frozenset({9})
    assert clip_tokens([1, 2, 3], stops, room=10) == (3, None)
    assert clip_tokens([1, 9, 3], stops, room=10) == (2, STOP)  # the stop id is kept
    assert clip_tokens([1, 2, 3], stops, room=2) == (2, LENGTH)
    assert clip_tokens([1, 2, 9], stops, room=3) == (3, STOP)
    assert clip_tokens([1, 2], stops, room=2) == (2, LENGTH)
