"""A decode step that fails, and a batch thread that dies, sync and overlapped: every caller
gets a final status, every block comes back, and a failed step spares later requests.

The failures are injected (a CPU step does not fail on its own): a step's forward raises once,
or the batch thread's collect does, after the real step ran."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from mili.engine.step.sampler import PendingSample
from mili.pb.common.v1 import sampling_pb2
from mili.rpc.client import insecure_channel
from mili.watchdog import Watchdog
from tests.decode.conftest import NUM_BLOCKS, tiny_decode_config
from tests.decode.harness import (
    Client,
    DecodeServerThread,
    PrefillPlayer,
    blocks_back,
    random_prompt,
)
from tests.decode.test_generate import GREEDY, prompt_stopping_at
from tests.decode.test_generate_stream import GREEDY as STREAM_GREEDY
from tests.decode.test_generate_stream import _Stream, _transfer


@pytest.fixture(params=["off", "on"], ids=["sync", "overlap"])
def server(tiny_model_dir: Path, request: pytest.FixtureRequest) -> Iterator[DecodeServerThread]:
    server = DecodeServerThread(tiny_decode_config(tiny_model_dir, request.param))
    yield server
    server.close()


def fail_once(after_calls: int, call: Callable[..., Any]) -> Callable[..., Any]:
    """`call`, except that its call number `after_calls` + 1 raises RuntimeError."""
    calls = 0

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == after_calls + 1:
            raise RuntimeError("injected step failure")
        return call(*args, **kwargs)

    return wrapped


async def outcome(client: Client, player: PrefillPlayer, name: str, max_tokens: int) -> Any:
    """The request's tokens, or the gRPC error that ended it."""
    prompt = random_prompt(9, player.vocab_size, seed=len(name))
    params = dataclasses.replace(GREEDY, max_tokens=max_tokens)
    try:
        return await client.run_request(player, name, prompt, params)
    except grpc.aio.AioRpcError as e:
        return e


@pytest.mark.parametrize("where", ["forward", "sampling", "read-back"])
def test_a_failed_step_fails_its_requests_and_spares_later_ones(
    server: DecodeServerThread,
    player: PrefillPlayer,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    """A step fails launching its forward (overlapped: maybe while the last step is still
    in flight), launching its sampling (overlapped: after its forward ran), or reading its
    ids back."""
    runner = server.instance.runner
    if where == "forward":  # every step's, launched ahead or not
        runner.decode_logits = fail_once(5, runner.decode_logits)  # type: ignore[method-assign]
    elif where == "sampling":
        sampler = runner.sampler
        sampler.launch = fail_once(5, sampler.launch)  # type: ignore[method-assign]
    else:  # the batch thread's reads only (the stand-in prefill here samples too)
        real = PendingSample.result
        failing = fail_once(5, real)

        def read_back(pending: PendingSample) -> Any:
            is_batcher = threading.current_thread().name == "decode-batcher"
            return failing(pending) if is_batcher else real(pending)

        monkeypatch.setattr(PendingSample, "result", read_back)

    async def body() -> None:
        async with insecure_channel(server.address) as channel:
            client = Client(channel)
            # 3 steps of the short one may run before the long ones join: it may finish
            failed = await asyncio.gather(
                *(outcome(client, player, f"doomed-{i}", 60) for i in range(3))
            )
            errors = [o for o in failed if isinstance(o, grpc.aio.AioRpcError)]
            assert errors, "the injected failure reached no request"
            assert all("injected step failure" in (e.details() or "") for e in errors)
            await blocks_back(client, NUM_BLOCKS)
            later = await outcome(client, player, "later", 20)
            assert not isinstance(later, grpc.aio.AioRpcError)
            assert len(later.token_ids) == 20
            await blocks_back(client, NUM_BLOCKS)

    server.run(body())


async def stream_outcome(client: Client, player: PrefillPlayer, max_tokens: int) -> Any:
    """One request over GenerateStream (the frontend's call): its tokens and finish reason, or
    the error event that ended it."""
    stream = _Stream(client)
    prompt = random_prompt(9, player.vocab_size, seed=1)
    params = dataclasses.replace(STREAM_GREEDY, max_tokens=max_tokens)
    await stream.start("r", prompt, params=params)
    token_ids: list[int] = []
    try:
        while True:
            for event in (await stream.read()).events:
                kind = event.WhichOneof("event")
                if kind == "admitted":
                    await _transfer(client, player, "r", prompt, event)
                elif kind == "error":
                    return event.error
                else:
                    token_ids += event.tokens.token_ids
                    if event.tokens.finish_reason:
                        return token_ids
    finally:
        stream.call.cancel()


@pytest.mark.parametrize("where", ["forward", "sampling"])
def test_a_failed_step_ends_a_streamed_request_after_its_tokens(
    server: DecodeServerThread, player: PrefillPlayer, where: str
) -> None:
    """Over GenerateStream a request's last tokens and its error may be delivered together
    (overlapped: step n's token and step n + 1's failure): the error still follows them
    (before, it stayed in the request's stream and the caller waited for good)."""
    runner = server.instance.runner
    if where == "forward":
        runner.decode_logits = fail_once(5, runner.decode_logits)  # type: ignore[method-assign]
    else:
        runner.sampler.launch = fail_once(5, runner.sampler.launch)  # type: ignore[method-assign]

    async def body() -> None:
        async with insecure_channel(server.address) as channel:
            client = Client(channel)
            await client.info()
            error = await stream_outcome(client, player, 60)
            assert not isinstance(error, list), f"finished: {len(error)} tokens"
            assert "injected step failure" in error.message
            await blocks_back(client, NUM_BLOCKS)

    server.run(body())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_batch_thread_ends_every_request_and_frees_every_block(
    server: DecodeServerThread, player: PrefillPlayer
) -> None:
    """A bug that kills the batch thread mid-step (here: collecting a step raises): the
    requests in flight, also those a pending token had already stopped, get a final status
    and all blocks come back once no step writes them."""
    batcher = server.instance.batcher
    batcher._collect = fail_once(8, batcher._collect)  # type: ignore[method-assign]

    async def body() -> None:
        async with insecure_channel(server.address) as channel:
            client = Client(channel)
            outcomes = await asyncio.gather(
                *(outcome(client, player, f"req-{i}", n) for i, n in enumerate([60, 60, 9]))
            )
            codes = [o.code() for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
            assert codes and set(codes) == {grpc.StatusCode.UNAVAILABLE}
            await blocks_back(client, NUM_BLOCKS)

    server.run(body())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_batch_thread_says_so_once_its_requests_are_failed(
    tiny_model_dir: Path, player: PrefillPlayer
) -> None:
    """The instance cannot serve once its batch thread died (it would admit requests, take
    their KV and fail them at the join): `on_death` hears of it, with the error, after every
    request was failed. The decode process drains and exits non-zero on it (__main__)."""
    deaths: list[tuple[BaseException, int]] = []
    server = DecodeServerThread(
        tiny_decode_config(tiny_model_dir, "off"),
        on_death=lambda e: deaths.append((e, server.instance.table.num_free_blocks)),
    )
    try:
        batcher = server.instance.batcher
        batcher._collect = fail_once(3, batcher._collect)  # type: ignore[method-assign]

        async def body() -> None:
            async with insecure_channel(server.address) as channel:
                client = Client(channel)
                error = await outcome(client, player, "dies", 20)
                assert isinstance(error, grpc.aio.AioRpcError)
                assert error.code() == grpc.StatusCode.UNAVAILABLE

        server.run(body())
        # The requests are failed first, on_death next: the client's UNAVAILABLE may come
        # before the thread got to it.
        batcher._thread.join(10)
        ((death, num_free),) = deaths
        assert batcher.death is death and "injected step failure" in str(death)
        assert num_free == NUM_BLOCKS
    finally:
        server.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_request_its_last_token_stopped_still_ends_when_the_thread_dies(
    server: DecodeServerThread, player: PrefillPlayer
) -> None:
    """Overlapped, a request step i's token stops is already in step i + 1, so its blocks
    and its last event wait for that step: the thread dying while collecting it must still
    deliver both (sync: the request simply ended before)."""
    prompt, reference, i = prompt_stopping_at(player, seed=500)
    params = dataclasses.replace(GREEDY, stop_token_ids=(reference[i],))
    batcher = server.instance.batcher
    batcher._collect = fail_once(i, batcher._collect)  # type: ignore[method-assign]

    async def body() -> None:
        async with insecure_channel(server.address) as channel:
            client = Client(channel)
            out = await client.run_request(player, "stopped", prompt, params)
            assert out.token_ids == reference[: i + 1]
            assert out.finish_reason == sampling_pb2.FINISH_REASON_STOP
            await blocks_back(client, NUM_BLOCKS)

    server.run(body())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_events_of_the_iteration_the_thread_died_in_still_go_out(
    server: DecodeServerThread, player: PrefillPlayer
) -> None:
    """A request ends (its last event is queued, its blocks back), then a bug kills the thread
    in the same iteration: the queued event still reaches the caller, before the others'
    UNAVAILABLE."""
    batcher = server.instance.batcher
    end = batcher._end

    def end_then_die(r: Any, *args: Any) -> None:
        end(r, *args)
        if r.request.request_id == "short":
            raise RuntimeError("injected bug after a request ended")

    batcher._end = end_then_die  # type: ignore[method-assign,assignment]

    async def body() -> None:
        async with insecure_channel(server.address) as channel:
            client = Client(channel)
            short, long = await asyncio.gather(
                outcome(client, player, "short", 4), outcome(client, player, "long", 200)
            )
            assert not isinstance(short, grpc.aio.AioRpcError)
            assert len(short.token_ids) == 4
            assert short.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
            assert isinstance(long, grpc.aio.AioRpcError)
            assert long.code() == grpc.StatusCode.UNAVAILABLE
            await blocks_back(client, NUM_BLOCKS)

    server.run(body())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_join_the_thread_breaks_on_ends_and_frees_its_blocks(
    server: DecodeServerThread, player: PrefillPlayer
) -> None:
    """A bug while a request joins the batch kills the thread: that request gets an error
    (before: its stream waited forever, taken from the inbox and never ended), its blocks come
    back, and the instance refuses what comes next."""
    batcher = server.instance.batcher
    add = batcher._add

    def add_broken(join: Any, out: Any) -> None:
        if join.request.request_id == "broken":
            raise RuntimeError("injected bug while joining")
        add(join, out)

    batcher._add = add_broken  # type: ignore[method-assign]

    async def body() -> None:
        async with insecure_channel(server.address) as channel:
            client = Client(channel)
            broken = await outcome(client, player, "broken", 8)
            assert isinstance(broken, grpc.aio.AioRpcError), broken
            assert "injected bug while joining" in (broken.details() or "")
            later = await outcome(client, player, "later", 8)
            assert isinstance(later, grpc.aio.AioRpcError)
            assert later.code() == grpc.StatusCode.UNAVAILABLE
            await blocks_back(client, NUM_BLOCKS)

    server.run(body())


def test_a_stuck_step_is_seen_by_the_watchdog(
    server: DecodeServerThread, player: PrefillPlayer
) -> None:
    """A step whose forward never returns (injected: a hung kernel cannot be made on the
    CPU): the batch thread's progress stops moving while a request waits on it, and the
    watchdog the process runs over it reports it, naming the step."""
    runner = server.instance.runner
    release = threading.Event()
    real = runner.decode_logits
    calls = 0

    def stuck_on_the_fifth(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 5:
            release.wait(30)
        return real(*args, **kwargs)

    runner.decode_logits = stuck_on_the_fifth  # type: ignore[method-assign]
    stalls: list[str] = []
    watchdog = Watchdog(server.instance.batcher.progress, 1.0, stalls.append, "decode")
    watchdog.start()

    async def body() -> None:
        async with insecure_channel(server.address) as channel:
            client = Client(channel)
            request = asyncio.ensure_future(outcome(client, player, "stuck", 20))
            for _ in range(200):
                if stalls:
                    break
                await asyncio.sleep(0.05)
            assert stalls and stalls[0].startswith("decode: a decode step of 1 request has")
            assert not request.done()
            release.set()  # the step returns after all: the request finishes
            done = await request
            assert not isinstance(done, grpc.aio.AioRpcError) and len(done.token_ids) == 20
            await blocks_back(client, NUM_BLOCKS)

    try:
        server.run(body())
    finally:
        release.set()
        watchdog.stop()
    assert len(stalls) == 1
