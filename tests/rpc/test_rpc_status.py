"""Exceptions raised by servicers reach callers as the right status, message and details."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2

from mili import errors
from mili.rpc.server_config import ServerConfig
from mili.rpc.status import (
    STATUS_HEADER_KEY,
    bad_request_of,
    details_of,
    retry_info_of,
    server_status_of,
    status_of,
    unavailable_peer_of,
)

METHOD = "/mili.test.v1.EchoService/Unary"

DOMAIN_ERRORS = [
    (errors.InvalidArgument("sampling.top_p", 1.5, "must be in (0, 1]"), "INVALID_ARGUMENT"),
    (errors.NotFound("request r-7 not found"), "NOT_FOUND"),
    (
        errors.FailedPrecondition("KV layouts differ: 16 vs 32 tokens per block"),
        "FAILED_PRECONDITION",
    ),
    (errors.ResourceExhausted("no free KV blocks (0 of 512)"), "RESOURCE_EXHAUSTED"),
    (errors.Unavailable("decode d1 is down"), "UNAVAILABLE"),
    (errors.DeadlineExceeded("deadline passed after 3 of 9 layers"), "DEADLINE_EXCEEDED"),
    (errors.Cancelled("request r-7 cancelled by its caller"), "CANCELLED"),
    (errors.DataLoss("KV chunk 3 of r-7: checksum mismatch"), "DATA_LOSS"),
]


async def _fail(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def _fail_stream(call: Any) -> tuple[list[bytes], grpc.aio.AioRpcError]:
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for message in call:
            got.append(message)
    return got, info.value


async def _requests(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


# ---- pure mapping ------------------------------------------------------------------------------


@pytest.mark.parametrize(("error", "code"), DOMAIN_ERRORS)
def test_status_of_domain_errors(error: Exception, code: str) -> None:
    status = status_of(error, METHOD)
    assert status.code.name == code
    assert status.details == str(error)
    [(key, _)] = status.trailing_metadata
    assert key == "grpc-status-details-bin"


def test_status_of_unexpected_exception_names_method_and_type() -> None:
    status = status_of(ValueError("boom"), METHOD)
    assert status.code is grpc.StatusCode.INTERNAL
    assert status.details == f"internal error in {METHOD}: ValueError: boom; see server log"


def test_status_of_downstream_rpc_error_shows_its_code() -> None:
    downstream = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "connect failed"
    )
    status = status_of(downstream, METHOD)
    assert status.code is grpc.StatusCode.INTERNAL
    assert status.details == (
        f"internal error in {METHOD}: AioRpcError: UNAVAILABLE: connect failed; see server log"
    )


def test_status_of_clips_huge_messages() -> None:
    status = status_of(errors.NotFound("x" * 100_000), METHOD)
    assert len(status.details) == 1500
    assert status.details.endswith("...")


# ---- over the wire -----------------------------------------------------------------------------


@pytest.mark.parametrize(("error", "code"), DOMAIN_ERRORS)
def test_domain_error_reaches_caller(echo_server: Any, error: Exception, code: str) -> None:
    async def main() -> None:
        async with echo_server() as h:
            h.echo.error = error
            err = await _fail(h.unary()(b"hi"))
            assert err.code().name == code
            assert err.details() == str(error)

    asyncio.run(main())


def test_invalid_argument_carries_field_violations(echo_server: Any) -> None:
    async def main() -> None:
        async with echo_server() as h:
            h.echo.error = errors.InvalidArgument.many(
                [
                    errors.FieldViolation("sampling.top_p", "must be in (0, 1] (got 1.5)"),
                    errors.FieldViolation("max_tokens", "must be > 0 (got 0)"),
                ]
            )
            err = await _fail(h.unary()(b"hi"))
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert err.details() == (
                "sampling.top_p: must be in (0, 1] (got 1.5); max_tokens: must be > 0 (got 0)"
            )
            bad = bad_request_of(err)
            assert bad is not None
            assert [(v.field, v.description) for v in bad.field_violations] == [
                ("sampling.top_p", "must be in (0, 1] (got 1.5)"),
                ("max_tokens", "must be > 0 (got 0)"),
            ]
            assert retry_info_of(err) is None

    asyncio.run(main())


def test_resource_exhausted_carries_retry_delay(echo_server: Any) -> None:
    async def main() -> None:
        async with echo_server() as h:
            h.echo.error = errors.ResourceExhausted("queue full (64 waiting)", retry_after_s=1.25)
            err = await _fail(h.unary()(b"hi"))
            assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            info = retry_info_of(err)
            assert info is not None
            assert info.retry_delay == duration_pb2.Duration(seconds=1, nanos=250_000_000)
            assert details_of(err) == [info]

            h.echo.error = errors.ResourceExhausted("queue full (64 waiting)")
            err = await _fail(h.unary()(b"hi"))
            assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert details_of(err) == []

    asyncio.run(main())


def test_peer_unavailable_names_the_peer_and_plain_unavailable_does_not(echo_server: Any) -> None:
    async def main() -> None:
        async with echo_server() as h:
            h.echo.error = errors.PeerUnavailable("KV to decode d1 failed", peer="10.0.0.7:50061")
            err = await _fail(h.unary()(b"hi"))
            assert err.code() is grpc.StatusCode.UNAVAILABLE
            assert unavailable_peer_of(err) == "10.0.0.7:50061"
            [info] = details_of(err)
            assert isinstance(info, error_details_pb2.ErrorInfo)
            assert (info.reason, info.domain) == ("PEER_UNAVAILABLE", "mili")

            h.echo.error = errors.Unavailable("draining")
            err = await _fail(h.unary()(b"hi"))
            assert err.code() is grpc.StatusCode.UNAVAILABLE
            assert unavailable_peer_of(err) is None

    asyncio.run(main())


def test_unexpected_exception_is_internal_and_logged_once(
    echo_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async with echo_server() as h:
            h.echo.error = KeyError("block 17")
            err = await _fail(h.unary()(b"hi"))
            assert err.code() is grpc.StatusCode.INTERNAL
            assert err.details() == (
                "internal error in /mili.test.v1.EchoService/Unary: KeyError: 'block 17'; "
                "see server log"
            )
            assert details_of(err) == []

    with caplog.at_level(logging.DEBUG, logger="mili.rpc"):
        asyncio.run(main())
    logged = [r for r in caplog.records if r.name == "mili.rpc" and r.levelno >= logging.ERROR]
    assert len(logged) == 1
    assert logged[0].exc_info is not None and logged[0].exc_info[0] is KeyError
    assert "/mili.test.v1.EchoService/Unary" in logged[0].getMessage()


def test_not_implemented_is_unimplemented(echo_server: Any) -> None:
    async def main() -> None:
        async with echo_server() as h:
            h.echo.error = NotImplementedError("speculative decoding")
            err = await _fail(h.unary()(b"hi"))
            assert err.code() is grpc.StatusCode.UNIMPLEMENTED
            assert err.details() == (
                "/mili.test.v1.EchoService/Unary is not implemented: speculative decoding"
            )

    asyncio.run(main())


def test_context_abort_passes_through(echo_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with echo_server() as h:
            err = await _fail(h.unary("Abort")(b"hi"))
            assert err.code() is grpc.StatusCode.PERMISSION_DENIED
            assert err.details() == "caller may not do this"
            assert details_of(err) == []

    with caplog.at_level(logging.DEBUG, logger="mili.rpc"):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_status_racing_the_callers_deadline_ends_quietly(
    echo_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A request that fails with DEADLINE_EXCEEDED just as grpc core ends the call for the same
    deadline: the status cannot be sent any more, and that is no server error to log."""

    async def one(h: Any) -> grpc.StatusCode:
        error = await _fail_stream(h.server_stream("Late")(b"x", timeout=0.2))
        return error[1].code()

    async def main() -> list[grpc.StatusCode]:
        async with echo_server() as h:
            return list(await asyncio.gather(*(one(h) for _ in range(200))))

    with caplog.at_level(logging.DEBUG):
        codes = asyncio.run(main())
    assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}
    errors_logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors_logged, errors_logged[:3]


@pytest.mark.parametrize("method", ["ServerStream", "ServerStreamWriter"])
def test_server_stream_error_mid_stream(echo_server: Any, method: str) -> None:
    async def main() -> None:
        async with echo_server() as h:
            h.echo.error = errors.NotFound("request r-7 not found")
            got, err = await _fail_stream(h.server_stream(method)(b"tok"))
            assert got == [b"tok"]  # the message sent before the error still arrived
            assert err.code() is grpc.StatusCode.NOT_FOUND
            assert err.details() == "request r-7 not found"

            h.echo.error = RuntimeError("worker died")
            got, err = await _fail_stream(h.server_stream(method)(b"tok"))
            assert got == [b"tok"]
            assert err.code() is grpc.StatusCode.INTERNAL
            assert err.details() == (
                f"internal error in /mili.test.v1.EchoService/{method}: "
                "RuntimeError: worker died; see server log"
            )

            h.echo.error = None
            assert [m async for m in h.server_stream(method)(b"ok")] == [b"ok", b"ok"]

    asyncio.run(main())


def test_client_stream_error(echo_server: Any) -> None:
    async def main() -> None:
        async with echo_server() as h:
            assert await h.client_stream()(_requests(b"a", b"b")) == b"ab"
            h.echo.error = errors.DataLoss("KV chunk 2 of r-7: 10 bytes short")
            err = await _fail(h.client_stream()(_requests(b"a", b"b")))
            assert err.code() is grpc.StatusCode.DATA_LOSS
            assert err.details() == "KV chunk 2 of r-7: 10 bytes short"

    asyncio.run(main())


def test_bidi_stream_error_mid_stream(echo_server: Any) -> None:
    async def main() -> None:
        async with echo_server() as h:
            h.echo.error = errors.InvalidArgument("block_ids", [3, 3], "must be distinct")
            got, err = await _fail_stream(h.bidi_stream()(_requests(b"a", b"b")))
            assert got == [b"a"]
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
            bad = bad_request_of(err)
            assert bad is not None
            assert bad.field_violations[0].field == "block_ids"
            assert bad.field_violations[0].description == "must be distinct (got [3, 3])"

    asyncio.run(main())


def test_sync_handler_is_served_unwrapped(echo_server: Any) -> None:
    async def main() -> None:
        async with echo_server() as h:
            assert await h.unary("SyncUnary")(b"x") == b"sync:x"

    asyncio.run(main())


def test_details_of_plain_error_is_empty(echo_server: Any) -> None:
    async def main() -> None:
        async with echo_server() as h:
            err = await _fail(h.channel.unary_unary("/mili.test.v1.EchoService/Nope")(b""))
            assert err.code() is grpc.StatusCode.UNIMPLEMENTED
            assert details_of(err) == []
            assert bad_request_of(err) is None

    asyncio.run(main())


def test_bad_request_detail_type_is_the_public_one() -> None:
    err = grpc.aio.AioRpcError(
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(
            *status_of(errors.InvalidArgument("f", 1, "bad"), METHOD).trailing_metadata
        ),
        "f: bad (got 1)",
    )
    [detail] = details_of(err)
    assert isinstance(detail, error_details_pb2.BadRequest)


# ---- a client-streaming call announces its status in the initial metadata too ---------------


def _announced(err: grpc.aio.AioRpcError) -> status_pb2.Status | None:
    found = [v for k, v in err.initial_metadata() or () if k == STATUS_HEADER_KEY]
    return status_pb2.Status.FromString(found[0]) if found else None


def test_client_stream_error_is_announced_in_the_initial_metadata(echo_server: Any) -> None:
    async def main() -> None:
        async with echo_server() as h:
            h.echo.error = errors.ResourceExhausted("no free KV blocks", retry_after_s=0.5)
            err = await _fail(h.client_stream()(_requests(b"a", b"b")))
            announced = _announced(err)
            assert announced is not None
            assert (announced.code, announced.message) == (
                grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                "no free KV blocks",
            )
            assert len(announced.details) == 1  # the RetryInfo, as in the trailers
            assert server_status_of(err).code is grpc.StatusCode.RESOURCE_EXHAUSTED

            h.echo.error = errors.DataLoss("chunk 3: checksum mismatch")  # bidi, mid-stream:
            got, err = await _fail_stream(h.bidi_stream()(_requests(b"a")))
            assert got == [b"a"] and err.code() is grpc.StatusCode.DATA_LOSS
            assert _announced(err) is None  # the initial metadata went out with b"a"

            h.echo.error = errors.NotFound("r-7")  # unary requests cannot race: nothing sent
            err = await _fail(h.unary()(b"hi"))
            assert err.code() is grpc.StatusCode.NOT_FOUND and _announced(err) is None

    asyncio.run(main())


def test_draining_refusal_of_a_client_stream_is_announced(echo_server: Any, until: Any) -> None:
    async def main() -> None:
        async with echo_server(ServerConfig(drain_timeout_s=5.0, grace_s=1.0)) as h:
            held = h.server_stream("Hold")(b"")  # keeps the drain going
            assert await held.read() == b"started"
            drain = asyncio.create_task(h.server.drain())
            await until(lambda: h.server.is_draining)
            err = await _fail(h.client_stream()(_requests(b"a")))
            assert err.code() is grpc.StatusCode.UNAVAILABLE
            announced = _announced(err)
            assert announced is not None
            assert announced.code == grpc.StatusCode.UNAVAILABLE.value[0]
            h.echo.release.set()
            await drain

    asyncio.run(main())


def _internal_from_core(initial: tuple[tuple[str, bytes], ...]) -> grpc.aio.AioRpcError:
    """What grpc.aio raises when a write raced the server's status: that status is gone."""
    return grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL,
        grpc.aio.Metadata(*initial),
        grpc.aio.Metadata(),
        "Internal error from Core",
    )


def test_server_status_of_prefers_the_announced_status_over_grpcs_internal() -> None:
    status = status_of(errors.InvalidArgument("block_ids", [3, 3], "must be distinct"), "/m")
    [(key, value)] = status.trailing_metadata
    err = _internal_from_core(((STATUS_HEADER_KEY, value),))
    found = server_status_of(err)
    assert found.code is grpc.StatusCode.INVALID_ARGUMENT
    assert found.details == "block_ids: must be distinct (got [3, 3])"
    assert found.trailing_metadata == ((key, value),)  # the details, for details_of & co

    # No announcement, or the server's own INTERNAL: the error's own status stands.
    assert server_status_of(_internal_from_core(())).details == "Internal error from Core"
    own = status_pb2.Status(code=grpc.StatusCode.INTERNAL.value[0], message="bug")
    found = server_status_of(_internal_from_core(((STATUS_HEADER_KEY, own.SerializeToString()),)))
    assert (found.code, found.details) == (grpc.StatusCode.INTERNAL, "Internal error from Core")

    # Any other code is the call's real end (e.g. our own deadline): never replaced.
    late = grpc.aio.AioRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.aio.Metadata((STATUS_HEADER_KEY, value)),
        grpc.aio.Metadata(),
        "Deadline Exceeded",
    )
    assert server_status_of(late).code is grpc.StatusCode.DEADLINE_EXCEEDED


def test_client_stream_writes_racing_the_error_still_get_its_code(echo_server: Any) -> None:
    """Writes back to back while the server fails the call: grpc.aio turns a write that races the
    status into INTERNAL "Internal error from Core", at times over the server's status; the
    server's DATA_LOSS must still be what `server_status_of` finds, every time."""
    payload = bytes(1 << 20)

    async def main() -> None:
        async with echo_server() as h:
            h.echo.error = errors.DataLoss("chunk 0: checksum mismatch")
            for _ in range(20):
                call = h.client_stream()()
                with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):
                    while not call.done():
                        await call.write(payload)
                err = await _fail(call)
                found = server_status_of(err)
                assert found.code is grpc.StatusCode.DATA_LOSS, (err.code(), err.details())
                assert found.details == "chunk 0: checksum mismatch"

    asyncio.run(main())
