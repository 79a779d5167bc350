"""A client that reads slower than tokens come gets everything pending in one message: every token
exactly once and in order, stop strings matched once, usage exact, and a bounded buffer in the
frontend (coalescer.py), in isolation and over real gRPC with a deliberately slow reader."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import grpc
import pytest

from mili.engine.logprobs import TokenLogprobs
from mili.engine.stop import FinishReason
from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from services.frontend.coalescer import coalesced, merge
from services.frontend.pipeline import Delta
from tests.frontend.fakes import FakeDecode, collect, ids, stack, text_of

# A client whose HTTP/2 window holds ~1 KiB: the frontend's writes wait for it to read, as they
# would for a slow client once the transport's buffers are full.
_SLOW_CLIENT_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


def _deltas(n: int, pulled: list[int], *, fail: bool = False) -> AsyncGenerator[Delta, None]:
    async def gen() -> AsyncGenerator[Delta, None]:
        for i in range(n):
            pulled.append(i)
            last = i == n - 1 and not fail
            yield Delta(
                [i],
                str(i % 10),
                finish_reason=FinishReason.LENGTH if last else None,
                num_prompt_tokens=3,
                num_completion_tokens=i + 1,
            )
            await asyncio.sleep(0)
        if fail:
            raise RuntimeError("decode went away")

    return gen()


def test_a_slow_consumer_gets_every_delta_once_in_order_with_a_bounded_buffer() -> None:
    async def main() -> None:
        pulled: list[int] = []
        taken: list[Delta] = []
        most_ahead = 0
        async for delta in coalesced(_deltas(2000, pulled), max_buffered_tokens=50):
            taken.append(delta)
            num_taken = sum(len(d.token_ids) for d in taken)
            await asyncio.sleep(0.001)  # slower than the deltas come
            most_ahead = max(most_ahead, len(pulled) - num_taken)
        token_ids = [t for d in taken for t in d.token_ids]
        assert token_ids == list(range(2000))
        assert "".join(d.text for d in taken) == "".join(str(i % 10) for i in range(2000))
        assert len(taken) < 2000 / 5  # merged
        assert max(len(d.token_ids) for d in taken) <= 50
        assert most_ahead <= 50  # never pulled further ahead of the consumer than the bound
        last = taken[-1]
        assert last.finish_reason is FinishReason.LENGTH
        assert (last.num_prompt_tokens, last.num_completion_tokens) == (3, 2000)
        assert all(d.finish_reason is None for d in taken[:-1])

    asyncio.run(main())


def test_merged_deltas_keep_the_first_ones_prompt_logprobs() -> None:
    prompt_lp = [TokenLogprobs(-1.0, []), TokenLogprobs(-2.0, [])]
    first = Delta([1], "a", prompt_token_ids=[4, 5, 6], prompt_logprobs=prompt_lp)
    last = Delta([2], "b", finish_reason=FinishReason.STOP, num_prompt_tokens=3)
    merged = merge([first, Delta([3], "c"), last])
    assert merged.prompt_logprobs == prompt_lp and merged.prompt_token_ids == [4, 5, 6]
    assert merged.token_ids == [1, 3, 2] and merged.finish_reason is FinishReason.STOP


def test_an_error_comes_after_the_deltas_before_it_and_closing_closes_the_generation() -> None:
    async def main() -> None:
        pulled: list[int] = []
        taken: list[int] = []
        with pytest.raises(RuntimeError, match="decode went away"):
            async for delta in coalesced(_deltas(30, pulled, fail=True), max_buffered_tokens=8):
                taken.extend(delta.token_ids)
        assert taken == list(range(30))

        closed = asyncio.Event()

        async def endless() -> AsyncGenerator[Delta, None]:
            try:
                while True:
                    yield Delta([1], "a")
                    await asyncio.sleep(0)
            finally:
                closed.set()

        merged = coalesced(endless(), max_buffered_tokens=8)
        await anext(merged)
        await merged.aclose()
        assert closed.is_set()  # the generation's clean-up (cancelling decode) ran

    asyncio.run(main())


def test_a_stream_interval_sends_the_first_delta_at_once_then_every_n_ids() -> None:
    async def main() -> None:
        pulled: list[int] = []
        taken = [
            delta
            async for delta in coalesced(
                _deltas(23, pulled), max_buffered_tokens=50, stream_interval=4
            )
        ]
        assert [t for d in taken for t in d.token_ids] == list(range(23))
        assert "".join(d.text for d in taken) == "".join(str(i % 10) for i in range(23))
        sizes = [len(d.token_ids) for d in taken]
        assert sizes[0] == 1  # the first token is not held back
        assert all(n >= 4 for n in sizes[1:-1]), sizes
        assert len(taken) <= 2 + 22 // 4
        assert taken[-1].finish_reason is FinishReason.LENGTH
        assert (taken[-1].num_prompt_tokens, taken[-1].num_completion_tokens) == (3, 23)
        with pytest.raises(ValueError, match="stream_interval"):
            await anext(coalesced(_deltas(1, []), max_buffered_tokens=2, stream_interval=3))

    asyncio.run(main())


async def _read_slowly(address: str, request: generation_pb2.GenerateRequest) -> list[object]:
    async with grpc.aio.insecure_channel(address, options=_SLOW_CLIENT_OPTIONS) as channel:
        call = generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=60)
        responses = []
        async for response in call:
            responses.append(response)
            await asyncio.sleep(0.01)
        return responses


def test_a_slow_reader_gets_every_token_once_in_order_in_fewer_bounded_messages() -> None:
    script = [ids(chr(33 + i % 90)) for i in range(1500)]

    async def main() -> None:
        async with stack([FakeDecode(script=script)], max_buffered_tokens=64) as s:
            request = generation_pb2.GenerateRequest(
                prompt="x", sampling=sampling_pb2.SamplingParams(max_tokens=len(script))
            )
            responses = await _read_slowly(s.frontend.address, request)
        token_ids = [t for r in responses for t in r.token_ids]
        assert token_ids == [t for event in script for t in event]
        assert "".join(r.text for r in responses) == text_of(token_ids)
        assert len(responses) < len(script) / 3  # coalesced, not one message per token
        assert max(len(r.token_ids) for r in responses) <= 64  # the frontend's bound
        last = responses[-1]
        assert last.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == len(script)
        assert not any(r.finish_reason for r in responses[:-1])

    asyncio.run(main())


def test_a_stop_string_split_across_coalesced_messages_is_matched_once() -> None:
    # "STOP" arrives split over two decode events, deep in a stream the slow reader lags behind.
    script = [ids("ab")] * 300 + [ids("xST"), ids("OPy")] + [ids("cd")] * 300

    async def main() -> None:
        async with stack([FakeDecode(script=script)], max_buffered_tokens=64) as s:
            request = generation_pb2.GenerateRequest(
                prompt="x",
                sampling=sampling_pb2.SamplingParams(max_tokens=1500, stop=["STOP"]),
            )
            responses = await _read_slowly(s.frontend.address, request)
        assert "".join(r.text for r in responses) == "ab" * 300 + "x"
        token_ids = [t for r in responses for t in r.token_ids]
        # Tokens up to the one that completed the stop string ("P"), each once.
        assert token_ids == [t for event in script[:301] for t in event] + ids("OP")
        assert [r.finish_reason for r in responses].count(sampling_pb2.FINISH_REASON_STOP) == 1
        assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP
        assert responses[-1].usage.completion_tokens == len(token_ids)
        assert max(len(r.token_ids) for r in responses) > 3  # several events merged

    asyncio.run(main())


def test_closing_closes_a_generation_that_swallowed_its_cancellation() -> None:
    """asyncio.wait_for (Python 3.11) can return a result that came at the moment it was
    cancelled, swallowing the cancellation; the generation must still be closed."""

    async def main() -> None:
        closed = asyncio.Event()
        admitted = asyncio.Event()

        async def generation() -> AsyncGenerator[Delta, None]:
            try:
                # "Waiting for decode's admission": the cancellation is swallowed, as wait_for
                # does when the result is already there.
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(3600)
                admitted.set()
                while True:
                    yield Delta([1], "a")
                    await asyncio.sleep(0.01)
            finally:
                closed.set()

        merged = coalesced(generation(), max_buffered_tokens=8)
        first = asyncio.ensure_future(anext(merged))
        await asyncio.sleep(0.05)
        first.cancel()  # the client went away while nothing was sent yet
        await asyncio.wait({first}, timeout=5)
        assert first.done(), "closing waits forever on a generation that goes on"
        await asyncio.wait_for(closed.wait(), 5)
        assert admitted.is_set()

    asyncio.run(main())


def test_a_stop_string_split_across_held_messages_is_matched_once() -> None:
    # A reader that keeps up, a frontend that sends every 3 ids: "STOP" arrives split over two
    # decode events that go out in one message.
    script = [ids("ab")] * 10 + [ids("xST"), ids("OPy")] + [ids("cd")] * 10

    async def main() -> None:
        async with stack([FakeDecode(script=script)], stream_interval=3) as s:
            request = generation_pb2.GenerateRequest(
                prompt="x", sampling=sampling_pb2.SamplingParams(max_tokens=100, stop=["STOP"])
            )
            responses = await collect(s.stub.Generate(request, timeout=30))
        assert "".join(r.text for r in responses) == "ab" * 10 + "x"
        token_ids = [t for r in responses for t in r.token_ids]
        assert token_ids == [t for event in script[:11] for t in event] + ids("OP")
        assert [r.finish_reason for r in responses].count(sampling_pb2.FINISH_REASON_STOP) == 1
        assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP
        assert responses[-1].usage.completion_tokens == len(token_ids)
        assert len(responses[0].token_ids) == 2  # the first event at once
        assert all(len(r.token_ids) >= 3 for r in responses[1:-1])

    asyncio.run(main())
