"""Instances that hang (SIGSTOPped: their connections stay open, nothing answers) while
requests are out on them: the Info poller finds them not answering, and the requests there fail
or move on then, not when grpc's keepalive or decode's KV lease gives up."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from tests.frontend.fakes import FakeDecode, FakePrefill, code_of, collect, ids, stack, wait_until


def prompt(text: str = "hi") -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=text, sampling=sampling_pb2.SamplingParams())


def test_a_decode_that_stops_answering_mid_stream_fails_its_streams_when_marked_down() -> None:
    """Found by an exploratory test: the streams on a SIGSTOPped decode stayed open ~90 s
    (until keepalive ended the channel). Past the first token there is no retry: the request
    fails UNAVAILABLE naming the instance once the poller marks it down (info_timeout_s 0.5)."""

    async def main() -> None:
        hung = FakeDecode(hold=asyncio.Event(), hold_after=1)  # one event, then nothing
        async with stack([hung]) as s:
            address = s.backends.config.decode_addresses[0]
            call = s.stub.Generate(prompt(), timeout=10)
            first = await call.read()
            assert list(first.token_ids) == ids("ab")
            began = time.monotonic()
            hung.is_stopped = True
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert time.monotonic() - began < 3.0
            assert code_of(info.value) == grpc.StatusCode.UNAVAILABLE
            assert f"decode at {address} stopped answering" in info.value.details()
            hung.is_stopped = False
            hung.hold = None
            await wait_until(lambda: s.backends.router.decodes[address].is_up)
            replies = await collect(s.stub.Generate(prompt(), timeout=10))  # a new call
            assert replies[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH

    asyncio.run(main())


def test_a_decode_that_stops_answering_before_the_first_token_hands_its_requests_on() -> None:
    async def main() -> None:
        hung = FakeDecode(hold=asyncio.Event())  # admits, then holds before any token
        spare = FakeDecode()
        async with stack([hung, spare]) as s:
            calls = [s.stub.Generate(prompt(), timeout=10) for _ in range(2)]
            reading = [asyncio.ensure_future(collect(c)) for c in calls]
            await wait_until(lambda: len(hung.admitted) >= 1)
            hung.is_stopped = True
            began = time.monotonic()
            for replies in await asyncio.gather(*reading):
                assert [t for r in replies for t in r.token_ids] == ids("abc")
            assert time.monotonic() - began < 3.0
            assert spare.requests

    asyncio.run(main())


def test_a_prefill_that_stops_answering_hands_its_requests_to_another_when_marked_down() -> None:
    """Found by an exploratory test: the requests on a SIGSTOPped prefill failed 31 s later
    (decode's KV lease, blamed on decode) though another prefill was up. Before its first
    token a request starts again there once the poller marks the hung one down, decode's
    reservation of the first try released."""

    async def main() -> None:
        hung = FakePrefill(hold=asyncio.Event())  # takes the call, never answers it
        spare = FakePrefill()
        async with stack(prefill=hung, spare_prefills=[spare]) as s:
            reading = asyncio.ensure_future(collect(s.stub.Generate(prompt(), timeout=5)))
            await wait_until(lambda: hung.num_running == 1)
            hung.is_stopped = True
            began = time.monotonic()
            replies = await reading
            assert [t for r in replies for t in r.token_ids] == ids("abc")
            assert time.monotonic() - began < 3.0
            assert spare.requests
            assert hung.num_running == 0  # its call was cancelled
            await wait_until(lambda: s.decodes[0].num_reserved == 0)

    asyncio.run(main())


def test_one_slow_info_answer_cuts_nothing() -> None:
    """The poller routes around an instance at its first Info past info_timeout_s, but a busy
    instance may answer one poll late: its streams are cut only once it answered none for
    hung_after_s (1 s here: two polls)."""

    async def main() -> None:
        decode = FakeDecode(hold=asyncio.Event(), hold_after=1)
        async with stack([decode]) as s:
            address = s.backends.config.decode_addresses[0]
            call = s.stub.Generate(prompt(), timeout=10)
            assert list((await call.read()).token_ids) == ids("ab")
            decode.is_stopped = True  # one poll times out (0.5 s) ...
            await wait_until(lambda: not s.backends.router.decodes[address].is_up)
            decode.is_stopped = False  # ... the next answers
            await wait_until(lambda: s.backends.router.decodes[address].is_up)
            await asyncio.sleep(1.0)
            assert decode.hold is not None
            decode.hold.set()
            rest = await call.read()
            assert list(rest.token_ids) == ids("c")
            assert rest.finish_reason == sampling_pb2.FINISH_REASON_LENGTH

    asyncio.run(main())


def test_a_prefill_that_hangs_after_its_kv_landed_costs_only_its_statistics() -> None:
    """Its KV is in decode, which streams: cut once the poller finds it hung, the request
    goes on (it failed UNAVAILABLE when prefill's cut was read as the request's error). Only
    prefill's statistics are lost."""

    async def main() -> None:
        hung = FakePrefill(hold_reply=asyncio.Event())
        decode = FakeDecode(hold=asyncio.Event(), hold_after=1)
        async with stack([decode], prefill=hung) as s:
            call = s.stub.Generate(prompt(), timeout=10)
            assert list((await call.read()).token_ids) == ids("ab")
            hung.is_stopped = True
            address = s.backends.config.prefill_addresses[0]
            await wait_until(lambda: hung.num_running == 0, timeout_s=5.0)  # cut
            assert not s.backends.router.prefills[address].is_up
            assert decode.hold is not None
            decode.hold.set()
            last = await call.read()
            assert list(last.token_ids) == ids("c")
            assert last.finish_reason == sampling_pb2.FINISH_REASON_LENGTH

    asyncio.run(main())


def test_the_cut_of_a_hung_instance_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """Found by an operator's pass over the logs: the frontend cut a hung decode's calls with
    no line saying so (only "is down", at its first slow poll, seconds before). The cut is
    one WARNING line naming the instance, however many polls it then misses."""

    async def main() -> None:
        hung = FakeDecode(hold=asyncio.Event(), hold_after=1)
        async with stack([hung]) as s:
            address = s.backends.config.decode_addresses[0]
            call = s.stub.Generate(prompt(), timeout=10)
            await call.read()
            with caplog.at_level(logging.WARNING, logger="mili.frontend"):
                hung.is_stopped = True
                with pytest.raises(grpc.aio.AioRpcError):
                    await call.read()
                await asyncio.sleep(2.0)  # several more polls, still not answered
            cuts = [r.getMessage() for r in caplog.records if "cutting the calls" in r.getMessage()]
            assert len(cuts) == 1, cuts
            assert cuts[0].startswith(f"decode at {address} stopped answering (its Info: none for")

    asyncio.run(main())


def test_the_line_of_a_request_served_on_its_retry_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by an operator's pass over the logs: a request handed on from a hung decode was
    logged as any other, naming only the pair that served it (its first try was a DEBUG line).
    Its done line says it was retried, how often and why."""

    async def main() -> None:
        hung = FakeDecode(hold=asyncio.Event())  # admits, then holds before any token
        spare = FakeDecode()
        async with stack([hung, spare]) as s:
            hung_address = s.backends.config.decode_addresses[0]
            with caplog.at_level(logging.INFO, logger="mili.frontend"):
                calls = [s.stub.Generate(prompt(), timeout=10) for _ in range(2)]
                reading = [asyncio.ensure_future(collect(c)) for c in calls]
                await wait_until(lambda: len(hung.admitted) >= 1)
                hung.is_stopped = True
                await asyncio.gather(*reading)
            done = [r.getMessage() for r in caplog.records if " done: " in r.getMessage()]
            assert len(done) == 2, done
            retried = [line for line in done if "retried" in line]
            assert len(retried) == len(hung.admitted), done
            for line in retried:
                assert (
                    f"(retried 1 time: decode at {hung_address} stopped answering (its Info: none"
                ) in line

    asyncio.run(main())
