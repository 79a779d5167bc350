"""The admission queue over real gRPC against the fakes (fakes.py): a request that finds decode
(or prefill) full waits and then succeeds, in arrival order; cancelled or past its deadline it
leaves nothing reserved; past the queue's bound it is RESOURCE_EXHAUSTED with RetryInfo."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from mili.rpc.status import retry_info_of
from tests.frontend.fakes import (
    FakeDecode,
    FakePrefill,
    Stack,
    code_of,
    collect,
    stack,
    text_of,
    wait_until,
)


def prompt(text: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt=text, sampling=sampling_pb2.SamplingParams(max_tokens=8)
    )


def generate(s: Stack, text: str, timeout_s: float = 10.0) -> asyncio.Task[list[Any]]:
    return asyncio.create_task(collect(s.stub.Generate(prompt(text), timeout=timeout_s)))


def sample(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name)
    assert value is not None, f"{name} is not exported"
    return value


async def queued(s: Stack, n: int) -> None:
    await wait_until(lambda: s.backends.admitter.num_waiting == n)


def test_a_request_finding_decode_full_waits_and_then_succeeds() -> None:
    async def main() -> None:
        decode = FakeDecode(max_running=1, hold=asyncio.Event())
        async with stack([decode]) as s:
            registry = s.frontend.registry
            first = generate(s, "first")
            await wait_until(lambda: decode.num_reserved == 1)
            second = generate(s, "second")
            await queued(s, 1)
            assert sample(registry, "mili_frontend_queued_requests") == 1
            assert sample(registry, "mili_frontend_queued_prompt_tokens") == len("second")
            await asyncio.sleep(0.2)  # a few Info polls: it stays queued, nothing reserved
            assert decode.admitted == ["first"] and not second.done()
            assert decode.hold is not None
            decode.hold.set()
            for responses in await asyncio.gather(first, second):
                assert "".join(r.text for r in responses) == "abc"
            assert decode.admitted == ["first", "second"]
            assert sample(registry, "mili_frontend_queued_requests") == 0
            assert sample(registry, "mili_frontend_queue_wait_seconds_count") == 1
            assert sample(registry, "mili_frontend_queue_wait_seconds_sum") > 0.2
            await wait_until(lambda: decode.num_reserved == 0)

    asyncio.run(main())


def test_equal_requests_are_admitted_in_arrival_order() -> None:
    async def main() -> None:
        decode = FakeDecode(max_running=1, hold=asyncio.Event())
        async with stack([decode]) as s:
            calls = [generate(s, "r0")]
            await wait_until(lambda: decode.num_reserved == 1)
            for i in range(1, 6):
                calls.append(generate(s, f"r{i}"))
                await queued(s, i)
            assert decode.hold is not None
            decode.hold.set()
            await asyncio.gather(*calls)
            assert decode.admitted == [f"r{i}" for i in range(6)]

    asyncio.run(main())


def test_cancelled_or_expired_in_the_queue_leaves_nothing_reserved() -> None:
    async def main() -> None:
        decode = FakeDecode(max_running=1, hold=asyncio.Event())
        async with stack([decode]) as s:
            registry = s.frontend.registry
            first = generate(s, "first")
            await wait_until(lambda: decode.num_reserved == 1)
            cancelled = s.stub.Generate(prompt("cancelled"), timeout=10)
            reading = asyncio.create_task(collect(cancelled))
            await queued(s, 1)
            expiring = generate(s, "expiring", timeout_s=0.3)
            await queued(s, 2)
            cancelled.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await expiring
            assert code_of(info.value) == grpc.StatusCode.DEADLINE_EXCEEDED
            with pytest.raises(asyncio.CancelledError):
                await reading
            await queued(s, 0)
            assert decode.admitted == ["first"] and decode.num_reserved == 1
            assert s.prefill.num_running == 0 and len(s.prefill.requests) == 1
            assert decode.hold is not None
            decode.hold.set()
            await first
            await wait_until(lambda: decode.num_reserved == 0)
            assert sample(registry, "mili_frontend_queue_wait_seconds_count") == 2
            assert sample(registry, "mili_frontend_in_flight_requests") == 0

    asyncio.run(main())


def test_a_full_queue_is_resource_exhausted_with_retry_info() -> None:
    async def main() -> None:
        decode = FakeDecode(max_running=1, hold=asyncio.Event())
        async with stack([decode], max_queued_requests=1) as s:
            first = generate(s, "first")
            await wait_until(lambda: decode.num_reserved == 1)
            second = generate(s, "second")
            await queued(s, 1)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(s, "third")
            assert code_of(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert info.value.details() == (
                "1 request ahead of it in the queue, and the admission queue is full (1 of 1 "
                "request waiting); retry later"
            )
            retry = retry_info_of(info.value)  # FrontendConfig.retry_after_s
            assert retry is not None and retry.retry_delay.ToNanoseconds() == 500_000_000
            assert decode.hold is not None
            decode.hold.set()
            await asyncio.gather(first, second)
            assert decode.admitted == ["first", "second"]

    asyncio.run(main())


# Polls every 5 s below: only the requests' own comings and goings free room, so every call
# the fakes get is predictable.


def test_a_full_decode_is_not_asked_again_until_room_frees() -> None:
    async def main() -> None:
        decode = FakeDecode(max_running=1, hold=asyncio.Event())
        async with stack([decode], poll_interval_s=5.0) as s:
            first = generate(s, "first")
            await wait_until(lambda: decode.num_reserved == 1)
            later = [generate(s, "second")]
            await queued(s, 1)
            later.append(generate(s, "third"))
            await queued(s, 2)
            await asyncio.sleep(0.2)
            asked = [text_of(list(r.prompt_token_ids)) for r in decode.requests]
            assert asked == ["first", "second"]  # second refused once; third never asked
            assert decode.hold is not None
            decode.hold.set()
            await asyncio.gather(first, *later)
            asked = [text_of(list(r.prompt_token_ids)) for r in decode.requests]
            # first leaves: second is admitted; third tries next (refused once more unless
            # second was through by then), and is admitted once second leaves.
            assert asked[:3] == ["first", "second", "second"]
            assert asked[3:] in (["third"], ["third", "third"])
            assert decode.admitted == ["first", "second", "third"]

    asyncio.run(main())


def test_prefill_full_releases_decode_blocks_and_the_request_waits_its_turn() -> None:
    async def main() -> None:
        prefill = FakePrefill(max_running=1, hold=asyncio.Event())
        decode = FakeDecode()
        async with stack([decode], prefill=prefill, poll_interval_s=5.0) as s:
            first = generate(s, "first")
            await wait_until(lambda: prefill.num_running == 1)
            second = generate(s, "second")
            await queued(s, 1)
            # Decode admitted it, prefill turned it away: decode's blocks are released.
            await wait_until(lambda: decode.num_reserved == 1)
            assert decode.admitted == ["first", "second"]
            assert prefill.hold is not None
            prefill.hold.set()
            for responses in await asyncio.gather(first, second):
                assert "".join(r.text for r in responses) == "abc"
            # first's prefill ended: second is admitted again, in its place, under a fresh id
            # (decode may still hold the one it was told to cancel).
            assert decode.admitted == ["first", "second", "second"]
            ids = [r.request_id for r in decode.requests]
            assert ids[2] == f"{ids[1]}.2" and len(set(ids)) == 3
            assert [text_of(list(r.prompt_token_ids)) for r in prefill.requests] == [
                "first",
                "second",
                "second",
            ]
            await wait_until(lambda: decode.num_reserved == 0 and prefill.num_running == 0)

    asyncio.run(main())
