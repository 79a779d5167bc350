"""TokenStream: coalescing for lagging readers, errors after tokens, thread-safe delivery."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mili.engine.logprobs import TokenLogprobs
from mili.engine.stop import FinishReason
from mili.errors import DataLoss
from services.decode.stream import Outlets, TokenEvent, TokenStream, deliver_threadsafe

FINISH_LENGTH = FinishReason.LENGTH


def test_a_lagging_reader_gets_everything_in_one_event() -> None:
    async def body() -> None:
        stream = TokenStream()
        stream.push(TokenEvent([1], [TokenLogprobs(-0.5, [(1, -0.5)])]))
        stream.push(TokenEvent([2, 3], [TokenLogprobs(-1.0, []), TokenLogprobs(-2.0, [])]))
        stream.push(TokenEvent([4], [TokenLogprobs(-3.0, [])], FINISH_LENGTH))
        event = await stream.next()
        assert event.token_ids == [1, 2, 3, 4]
        assert event.logprobs is not None
        assert [lp.logprob for lp in event.logprobs] == [-0.5, -1.0, -2.0, -3.0]
        assert event.finish_reason == FINISH_LENGTH

    asyncio.run(body())


def test_error_comes_after_the_tokens_already_pushed() -> None:
    async def body() -> None:
        stream = TokenStream()
        stream.push(TokenEvent([7]))
        stream.fail(DataLoss("boom"))
        stream.fail(DataLoss("second"))  # the first error wins
        assert (await stream.next()).token_ids == [7]
        with pytest.raises(DataLoss, match="boom"):
            await stream.next()
        assert isinstance(await stream.wait_failed(), DataLoss)

    asyncio.run(body())


def test_next_times_out_when_nothing_arrives() -> None:
    async def body() -> None:
        with pytest.raises(TimeoutError):
            await TokenStream().next(timeout_s=0.01)

    asyncio.run(body())


def test_deliver_threadsafe_from_another_thread() -> None:
    async def body() -> None:
        streams = [TokenStream(asyncio.get_running_loop()) for _ in range(3)]

        def worker() -> None:
            for step in range(5):
                deliver_threadsafe([(s, TokenEvent([step])) for s in streams])
            deliver_threadsafe([(streams[2], DataLoss("late"))])

        thread = threading.Thread(target=worker)
        thread.start()
        await asyncio.to_thread(thread.join)
        for s in streams[:2]:
            assert (await s.next()).token_ids == [0, 1, 2, 3, 4]
        assert (await streams[2].next()).token_ids == [0, 1, 2, 3, 4]
        with pytest.raises(DataLoss):
            await streams[2].next()

    asyncio.run(body())


def test_an_outlet_lives_while_its_call_or_a_transfer_holds_it() -> None:
    outlets = Outlets()
    outlet = outlets.open("r1", TokenStream())
    held = outlets.hold("r1")  # a KV transfer into r1
    assert held is outlet and outlets.of("r1") is outlet
    outlets.release("r1", outlet)  # the call ended first: the transfer still finds the stream
    assert outlets.of("r1") is outlet and len(outlets) == 1
    outlets.release("r1", held)
    assert len(outlets) == 0
    # A stale release (of an earlier request with the same id) leaves the new one's outlet.
    new = outlets.open("r1", TokenStream())
    outlets.release("r1", outlet)
    assert outlets.of("r1") is new
