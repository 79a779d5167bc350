"""GenerateStream: many requests of one caller on one stream, each as its own Generate call
(tokens equal to the engine's, errors per request, cancellation, deadline, the stream's end
freeing what is open), with one message per step carrying the tokens of all of them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import grpc
import pytest

from mili.engine.sampling_params import SamplingParams
from mili.pb.common.v1 import sampling_pb2
from mili.pb.decode.v1 import decode_pb2
from mili.rpc.client import insecure_channel
from tests.decode.conftest import NUM_BLOCKS
from tests.decode.harness import (
    Client,
    DecodeServerThread,
    PrefillPlayer,
    blocks_back,
    random_prompt,
    sampling,
)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class _Stream:
    """One GenerateStream call: `start`/`cancel` write, `read` returns the next message."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self.call: Any = client.decode.GenerateStream(timeout=60)

    async def start(
        self,
        request_id: str,
        prompt: list[int],
        timeout_ms: int = 0,
        params: SamplingParams = GREEDY,
    ) -> None:
        assert self._client.layout is not None
        request = decode_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=sampling(params),
            prefill_layout=self._client.layout,
        )
        start = decode_pb2.StreamedGenerate(request=request, timeout_ms=timeout_ms)
        await self.call.write(decode_pb2.GenerateStreamRequest(starts=[start]))

    async def cancel(self, request_id: str) -> None:
        await self.call.write(decode_pb2.GenerateStreamRequest(cancel_request_ids=[request_id]))

    async def read(self) -> decode_pb2.GenerateStreamResponse:
        message = await asyncio.wait_for(self.call.read(), 30)
        assert message is not grpc.aio.EOF
        return message


async def _transfer(
    client: Client, player: PrefillPlayer, request_id: str, prompt: list[int], event: Any
) -> None:
    """Play prefill for an admitted request: its KV into the blocks decode reserved."""
    prefilled = await asyncio.to_thread(player.prefill, prompt, GREEDY)
    admitted = event.admitted
    blocks = list(admitted.prompt_block_ids)
    messages = player.messages(request_id, prompt, blocks, prefilled)
    messages[0].header.transfer_token = admitted.transfer_token
    transfer = client.kv.TransferKv(timeout=30)
    for message in messages:
        await transfer.write(message)
    await transfer.done_writing()
    await transfer


def test_requests_share_one_stream_and_equal_the_engine_with_errors_per_request(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    prompts = {f"mux-{i}": random_prompt(5 + 3 * i, player.vocab_size, seed=40 + i) for i in (0, 1)}
    expected = {rid: player.reference(p, GREEDY) for rid, p in prompts.items()}

    async def body() -> None:
        async with insecure_channel(decode_server.address) as channel:
            client = Client(channel)
            await client.info()
            stream = _Stream(client)
            for rid, prompt in prompts.items():
                await stream.start(rid, prompt)
            await stream.start("mux-bad", [])  # refused alone: the stream and the rest go on
            tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
            finished: set[str] = set()
            errors: dict[str, decode_pb2.RequestError] = {}
            num_shared = 0  # messages carrying tokens of both requests: one per step
            while len(finished) < len(prompts):
                message = await stream.read()
                with_tokens = set()
                for event in message.events:
                    kind = event.WhichOneof("event")
                    if kind == "admitted":
                        rid = event.request_id
                        await _transfer(client, player, rid, prompts[rid], event)
                    elif kind == "error":
                        errors[event.request_id] = event.error
                    else:
                        with_tokens.add(event.request_id)
                        tokens[event.request_id].extend(event.tokens.token_ids)
                        if event.tokens.finish_reason:
                            finished.add(event.request_id)
                num_shared += with_tokens == set(prompts)
            assert tokens == expected
            assert num_shared >= 1
            assert set(errors) == {"mux-bad"}
            assert errors["mux-bad"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "prompt_token_ids" in errors["mux-bad"].message
            await stream.call.done_writing()
            assert await stream.call.read() is grpc.aio.EOF  # nothing open: the stream ends
            await blocks_back(client, NUM_BLOCKS)

    decode_server.run(body())


def test_a_request_id_started_twice_ends_the_stream_not_the_request(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    """Found by an exploratory test: the second start of an open id was refused with an error
    event for that id, then the first was admitted: an error is a request's last event, so the
    caller read the open request as ended. The stream now ends INVALID_ARGUMENT naming the id,
    and what was open on it is freed."""
    prompt = random_prompt(9, player.vocab_size, seed=3)

    async def body() -> None:
        async with insecure_channel(decode_server.address) as channel:
            client = Client(channel)
            await client.info()
            # in one message, and in two
            for messages in ([["other", "twice", "twice"]], [["once"], ["once"]]):
                stream = _Stream(client)
                for rids in messages:
                    starts = [
                        decode_pb2.StreamedGenerate(
                            request=decode_pb2.GenerateRequest(
                                request_id=rid,
                                prompt_token_ids=prompt,
                                sampling=sampling(GREEDY),
                                prefill_layout=client.layout,
                            )
                        )
                        for rid in rids
                    ]
                    await stream.call.write(decode_pb2.GenerateStreamRequest(starts=starts))
                events = []
                with contextlib.suppress(grpc.aio.AioRpcError):
                    async for message in stream.call:
                        events += [(e.request_id, e.WhichOneof("event")) for e in message.events]
                assert await stream.call.code() == grpc.StatusCode.INVALID_ARGUMENT
                details = await stream.call.details()
                assert repr(messages[-1][-1]) in details and "already exists" in details, details
                assert all(kind == "admitted" for _, kind in events), events
                await blocks_back(client, NUM_BLOCKS)

    decode_server.run(body())


def test_cancel_deadline_and_the_stream_ending_free_each_request(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    prompt = random_prompt(20, player.vocab_size, seed=7)

    async def body() -> None:
        async with insecure_channel(decode_server.address) as channel:
            client = Client(channel)
            await client.info()
            stream = _Stream(client)
            await stream.start("mux-cancelled", prompt)
            assert (await stream.read()).events[0].WhichOneof("event") == "admitted"
            assert (await client.info()).num_free_blocks < NUM_BLOCKS
            await stream.cancel("mux-cancelled")
            await blocks_back(client, NUM_BLOCKS)  # freed, while the stream stays open

            await stream.start("mux-late", prompt, timeout_ms=200)  # no KV ever comes
            assert (await stream.read()).events[0].WhichOneof("event") == "admitted"
            event = (await stream.read()).events[0]
            assert event.request_id == "mux-late"
            assert event.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            await blocks_back(client, NUM_BLOCKS)

            await stream.start("mux-orphan", prompt)
            assert (await stream.read()).events[0].WhichOneof("event") == "admitted"
            stream.call.cancel()  # the caller goes away: as cancelling each call on it
            await blocks_back(client, NUM_BLOCKS)

    decode_server.run(body())


def test_a_start_still_admitting_when_its_stream_ends_is_counted() -> None:
    """The stream ends while a start waits in admission (a constraint's first compile): the
    request is counted CANCELLED and its span ended, not left open for good."""
    from prometheus_client import CollectorRegistry

    from mili.telemetry.metrics import RequestMetrics
    from services.decode.multiplex import Multiplexer

    class Compiling:  # admission waiting for a constraint's first compile
        async def admit(self, request: object) -> object:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    registry = CollectorRegistry()
    metrics = RequestMetrics(registry)
    mux = Multiplexer(
        Compiling(),  # type: ignore[arg-type]
        table=None,  # type: ignore[arg-type]
        outlets=None,  # type: ignore[arg-type]
        metrics=metrics,
        is_draining=lambda: False,
    )

    async def main() -> None:
        start = decode_pb2.StreamedGenerate(request=decode_pb2.GenerateRequest(request_id="r1"))
        queue: asyncio.Queue[decode_pb2.GenerateStreamRequest] = asyncio.Queue()
        await queue.put(decode_pb2.GenerateStreamRequest(starts=[start]))

        async def requests() -> Any:
            while True:
                yield await queue.get()

        stream = mux.run(requests())
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.1)
        first.cancel()  # the caller went away
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await stream.aclose()

    asyncio.run(main())
    labels = {"grpc_method": "Generate", "status": "CANCELLED"}
    counts = [
        s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == "mili_requests_total" and labels.items() <= s.labels.items()
    ]
    assert counts == [1.0]


def _driven(admission: Any, table: Any, outlets: Any) -> tuple[asyncio.Queue[Any], Any]:
    """A Multiplexer over `admission`, `table` and `outlets` (the caller's messages go on the
    queue; None: the caller closes its side), and the events it yields."""
    from services.decode.multiplex import Multiplexer

    mux = Multiplexer(admission, table, outlets, metrics=None, is_draining=lambda: False)
    queue: asyncio.Queue[decode_pb2.GenerateStreamRequest | None] = asyncio.Queue()

    async def requests() -> Any:
        while (message := await queue.get()) is not None:
            yield message

    return queue, mux.run(requests())


def test_an_id_still_open_on_the_stream_ends_the_stream_and_frees_the_open_one() -> None:
    """r1 ended in the request table (its last tokens waiting to be sent) when the caller
    starts another r1 on the same stream: the stream ends INVALID_ARGUMENT (an error event for
    r1 would read as the open r1's end), r1's blocks are back, and its deadline timer touches
    nothing (once, the new r1 took its place: the last tokens were never sent, and the old
    timer failed the new request with DEADLINE_EXCEEDED)."""
    from mili.engine.kv.block_pool import BlockPool
    from mili.errors import InvalidArgument
    from services.decode.requests import RequestTable
    from services.decode.stream import Outlets, TokenEvent, TokenStream

    table = RequestTable(BlockPool(16), block_size=4, max_requests=10)
    outlets = Outlets()

    class Admitting:  # the instance's admission, less the constraint compile and the checks
        async def admit(self, request: decode_pb2.GenerateRequest) -> object:
            params = SamplingParams(max_tokens=4)
            rid, ids = request.request_id, request.prompt_token_ids
            req = table.admit(rid, ids, params, lease_ms=60_000, now=time.monotonic())
            stream = TokenStream(asyncio.get_running_loop())
            return req, outlets.open(request.request_id, stream)

    def start(timeout_ms: int) -> decode_pb2.GenerateStreamRequest:
        request = decode_pb2.GenerateRequest(request_id="r1", prompt_token_ids=[5, 6, 7])
        return decode_pb2.GenerateStreamRequest(
            starts=[decode_pb2.StreamedGenerate(request=request, timeout_ms=timeout_ms)]
        )

    def seen(message: decode_pb2.GenerateStreamResponse) -> list[tuple[str, Any]]:
        return [
            (e.WhichOneof("event"), e.error.code if e.HasField("error") else e.tokens.finish_reason)
            for e in message.events
        ]

    async def main() -> None:
        queue, stream = _driven(Admitting(), table, outlets)
        await queue.put(start(timeout_ms=300))
        assert seen(await anext(stream)) == [("admitted", 0)]
        first = table.get("r1")
        assert first is not None  # as the batch thread runs it to its end:
        table.begin_transfer("r1", first.transfer_token)
        table.start_running(first)
        table.finish(first)
        outlets.of("r1").stream.push(TokenEvent([9], None, "length"))
        await queue.put(start(timeout_ms=0))  # not read yet: r1 is still open here
        with pytest.raises(InvalidArgument, match="already exists"):
            while True:
                assert seen(await asyncio.wait_for(anext(stream), 5)) == [
                    ("tokens", sampling_pb2.FINISH_REASON_LENGTH)
                ]
        assert table.get("r1") is None and table.num_free_blocks == 16
        await asyncio.sleep(0.4)  # past the first r1's deadline: nothing else to fail
        assert table.num_free_blocks == 16

    asyncio.run(main())


def test_a_start_waiting_for_its_compile_holds_back_no_other_start_or_cancel() -> None:
    """Found by a read-only review: starts were admitted one after the other, so one waiting
    for its constraint's first compile (up to seconds) held back every later start and cancel
    on the stream, past the frontend's admit timeout (which then took a healthy decode out of
    routing). Each start now runs on its own; a cancel reaches one still being admitted."""
    from mili.engine.kv.block_pool import BlockPool
    from services.decode.requests import RequestTable
    from services.decode.stream import Outlets, TokenStream

    table = RequestTable(BlockPool(16), block_size=4, max_requests=10)
    outlets = Outlets()
    compiled = asyncio.Event()

    class Admitting:  # "slow-*" requests wait for their constraint's compile
        async def admit(self, request: decode_pb2.GenerateRequest) -> object:
            if request.request_id.startswith("slow"):
                await compiled.wait()
            rid, ids = request.request_id, request.prompt_token_ids
            params = SamplingParams(max_tokens=4)
            req = table.admit(rid, ids, params, lease_ms=60_000, now=time.monotonic())
            return req, outlets.open(rid, TokenStream(asyncio.get_running_loop()))

    def start(*rids: str) -> decode_pb2.GenerateStreamRequest:
        return decode_pb2.GenerateStreamRequest(
            starts=[
                decode_pb2.StreamedGenerate(
                    request=decode_pb2.GenerateRequest(request_id=r, prompt_token_ids=[5, 6])
                )
                for r in rids
            ]
        )

    async def main() -> None:
        queue, stream = _driven(Admitting(), table, outlets)

        async def next_events() -> list[tuple[str, str]]:
            message = await asyncio.wait_for(anext(stream), 5)
            return [(e.request_id, e.WhichOneof("event") or "") for e in message.events]

        await queue.put(start("slow-a", "slow-b", "fast"))
        assert await next_events() == [("fast", "admitted")]  # not behind the compiles
        await queue.put(decode_pb2.GenerateStreamRequest(cancel_request_ids=["slow-a"]))
        assert await next_events() == [("slow-a", "error")]  # cancelled while being admitted
        compiled.set()
        assert await next_events() == [("slow-b", "admitted")]
        await queue.put(decode_pb2.GenerateStreamRequest(cancel_request_ids=["slow-b", "fast"]))
        # A start and its cancel in one message: its task is cancelled before it ever ran.
        late = start("late")
        late.cancel_request_ids.append("late")
        await queue.put(late)
        await queue.put(None)

        async def rest() -> list[decode_pb2.StreamedEvent]:
            return [e async for m in stream for e in m.events]

        assert await asyncio.wait_for(rest(), 5) == []  # the stream ends: nothing left on it
        assert table.num_free_blocks == 16

    asyncio.run(main())
