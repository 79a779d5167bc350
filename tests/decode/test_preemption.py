"""Blocks that grow as requests run, and preemption when the pool runs dry, over real gRPC:
requests that together outgrow decode's pool are preempted (the newest first), computed again
when blocks free, and still give the single-process engine's tokens; every block comes back.

Admission here reserves one block of outputs (block_pool.ADMISSION_OUTPUT_TOKENS, 256 in
service, shrunk so the tiny model's short generations grow past it), in both step modes."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from mili.engine.kv import block_pool
from mili.engine.sampling_params import SamplingParams
from mili.pb.decode.v1 import decode_pb2
from mili.rpc.client import insecure_channel
from services.decode import preemption
from services.decode.requests import RequestState, RequestTable
from tests.decode.conftest import BLOCK_SIZE, tiny_decode_config
from tests.decode.harness import (
    Client,
    DecodeServerThread,
    Outcome,
    PrefillPlayer,
    Reserved,
    blocks_back,
    eventually,
    random_prompt,
    sampling,
)
from tests.decode.test_generate import GREEDY

NUM_BLOCKS = 12  # 96 positions: each request below needs 10 blocks at its longest


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "overlap"])
def small_server(
    tiny_model_dir: Path, request: pytest.FixtureRequest
) -> Iterator[DecodeServerThread]:
    config = tiny_decode_config(tiny_model_dir, request.param)
    engine = dataclasses.replace(config.engine, num_blocks=NUM_BLOCKS)
    server = DecodeServerThread(dataclasses.replace(config, engine=engine))
    yield server
    server.close()


@pytest.fixture(autouse=True)
def one_block_of_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_pool, "ADMISSION_OUTPUT_TOKENS", BLOCK_SIZE)


async def _admit_all(
    client: Client, asks: list[tuple[str, list[int], SamplingParams]]
) -> list[tuple[object, Reserved]]:
    """Admit every request before any runs: once they run, the pool they fill is gone."""
    admitted = []
    for request_id, prompt, params in asks:
        request = decode_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling(params)
        )
        admitted.append(await client.admit(request))
    return admitted


async def _transfer_and_collect(
    client: Client,
    player: PrefillPlayer,
    ask: tuple[str, list[int], SamplingParams],
    admitted: tuple[object, Reserved],
) -> Outcome:
    request_id, prompt, params = ask
    prefilled = await asyncio.to_thread(player.prefill, prompt, params)
    return await client.transfer_and_collect(player, request_id, prompt, admitted, prefilled)


def _fill(
    player: PrefillPlayer, name: str, seed: int
) -> list[tuple[str, list[int], SamplingParams]]:
    """Three requests that fill the pool at admission and outgrow it together."""
    return [
        (
            f"{name}-{i}",
            random_prompt(20, player.vocab_size, seed + i),
            dataclasses.replace(GREEDY, max_tokens=60),
        )
        for i in range(3)
    ]


async def _start_all(
    client: Client, player: PrefillPlayer, asks: list[tuple[str, list[int], SamplingParams]]
) -> tuple[list[tuple[object, Reserved]], list[asyncio.Task[Outcome]]]:
    """Admit every request, then transfer each one's KV and collect its tokens in a task."""
    admitted = await _admit_all(client, asks)
    runs = [
        asyncio.create_task(_transfer_and_collect(client, player, ask, a))
        for ask, a in zip(asks, admitted, strict=True)
    ]
    return admitted, runs


def test_requests_that_outgrow_the_pool_are_preempted_and_give_the_engines_tokens(
    small_server: DecodeServerThread, player: PrefillPlayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 20-token prompts: 4 blocks each at admission (positions 0..26), the 12 there are; 10
    # each at their longest (20 + 60 - 1 positions)
    asks = [
        (
            "oldest",
            random_prompt(20, player.vocab_size, 1),
            dataclasses.replace(GREEDY, max_tokens=60),
        ),
        (
            "seeded",
            random_prompt(20, player.vocab_size, 2),
            SamplingParams(temperature=1.0, max_tokens=60, seed=7, ignore_eos=True, logprobs=1),
        ),
        (
            "penalized",
            random_prompt(20, player.vocab_size, 3),
            SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=60, ignore_eos=True),
        ),
    ]
    expected = [player.reference(prompt, params) for _, prompt, params in asks]
    batcher = small_server.instance.batcher
    preemptions = batcher.num_preemptions
    monkeypatch.setattr(preemption, "RECOMPUTE_CHUNK_TOKENS", 8)  # resumes of several chunks
    said: list[str] = []  # what the batch thread told its watchdog it was doing
    busy = batcher.progress.busy
    monkeypatch.setattr(batcher.progress, "busy", lambda what: (said.append(what), busy(what)))

    async def body() -> None:
        async with insecure_channel(small_server.address) as channel:
            client = Client(channel)
            admitted = await _admit_all(client, asks)
            info = await client.info()
            assert info.num_free_blocks == 0  # admission took 4 blocks each, not 10
            outcomes = await asyncio.gather(
                *(
                    _transfer_and_collect(client, player, ask, a)
                    for ask, a in zip(asks, admitted, strict=True)
                )
            )
            assert [o.token_ids for o in outcomes] == expected
            assert len(outcomes[1].logprobs) == 60
            await blocks_back(client, NUM_BLOCKS)

    small_server.run(body())
    assert batcher.num_preemptions - preemptions >= 2  # every growth past the pool preempted
    chunks = [i for i, w in enumerate(said) if w.startswith("computing again")]
    assert chunks, said
    # A resume's chunks come an iteration apart, the batch's steps between them.
    for i, j in itertools.pairwise(chunks):
        if _position(said[j]) > _position(said[i]):  # the same resume's next chunk
            assert any(w.startswith("a decode step of") for w in said[i:j]), said[i : j + 1]


def _position(what: str) -> int:
    return int(what.split(" at position ")[1].split()[0])


def test_no_request_is_admitted_while_one_waits_preempted(
    small_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    """The blocks that free go to the preempted request first: a newcomer is refused
    (RESOURCE_EXHAUSTED, retry later) until it has resumed, then admitted."""
    asks = _fill(player, "fill", 10)
    late = random_prompt(20, player.vocab_size, 20)
    table = small_server.instance.table

    async def body() -> None:
        async with insecure_channel(small_server.address) as channel:
            client = Client(channel)
            _, runs = await _start_all(client, player, asks)
            while not table.num_preempted:
                assert not all(r.done() for r in runs), "no request was preempted"
                await asyncio.sleep(0.005)
            request = decode_pb2.GenerateRequest(
                request_id="late", prompt_token_ids=late, sampling=sampling(GREEDY)
            )
            call = client.generate(request, timeout=30)
            with pytest.raises(Exception, match="preempted request"):
                await call.read()
            outcomes = await asyncio.gather(*runs)
            assert all(len(o.token_ids) == 60 for o in outcomes)
            await blocks_back(client, NUM_BLOCKS)
            call, reserved = await client.admit(
                decode_pb2.GenerateRequest(
                    request_id="late-again", prompt_token_ids=late, sampling=sampling(GREEDY)
                )
            )
            assert len(reserved) == 3  # its prompt's blocks
            call.cancel()
            await blocks_back(client, NUM_BLOCKS)

    small_server.run(body())


def _hold_resumes(table: RequestTable, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """No preempted request gets its blocks back until the event returned is set."""
    resume = table.resume
    may_resume = threading.Event()

    def held(*args: Any, **kwargs: Any) -> int | None:
        return resume(*args, **kwargs) if may_resume.is_set() else None

    monkeypatch.setattr(table, "resume", held)
    return may_resume


def test_a_request_cancelled_while_preempted_ends_and_the_rest_finish(
    small_server: DecodeServerThread, player: PrefillPlayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It ends where it waits, never resumed: here no request may resume until the cancelled
    one has ended (it leaves the table while resuming is held)."""
    asks = _fill(player, "cancel", 30)
    table = small_server.instance.table
    may_resume = _hold_resumes(table, monkeypatch)

    async def body() -> None:
        async with insecure_channel(small_server.address) as channel:
            client = Client(channel)
            admitted, runs = await _start_all(client, player, asks)
            await eventually(lambda: table.num_preempted > 0)
            assert table.num_running + table.num_preempted == 3
            victim = next(i for i, a in enumerate(asks) if _is_preempted(table, a[0]))
            admitted[victim][0].cancel()  # type: ignore[attr-defined]
            await eventually(lambda: table.get(asks[victim][0]) is None)  # ended
            may_resume.set()
            outcomes = await asyncio.gather(*runs, return_exceptions=True)
            assert isinstance(outcomes[victim], BaseException)
            kept = [o for i, o in enumerate(outcomes) if i != victim]
            assert all(isinstance(o, Outcome) and len(o.token_ids) == 60 for o in kept), kept
            await blocks_back(client, NUM_BLOCKS)
            assert table.num_preempted == 0

    small_server.run(body())


def _is_preempted(table: object, request_id: str) -> bool:
    request = table.get(request_id)  # type: ignore[attr-defined]
    return request is not None and request.is_preempted


def test_a_recompute_that_fails_fails_its_request_alone(
    small_server: DecodeServerThread, player: PrefillPlayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    asks = _fill(player, "broken", 40)
    runner = small_server.instance.runner

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the device is gone")

    async def body() -> None:
        async with insecure_channel(small_server.address) as channel:
            client = Client(channel)
            admitted = await _admit_all(client, asks)
            monkeypatch.setattr(runner, "prefill", broken)  # decode runs prefill to resume only
            outcomes = await asyncio.gather(
                *(
                    _transfer_and_collect(client, player, ask, a)
                    for ask, a in zip(asks, admitted, strict=True)
                ),
                return_exceptions=True,
            )
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            assert failed and all("the device is gone" in str(e) for e in failed), outcomes
            finished = [o for o in outcomes if isinstance(o, Outcome)]
            assert finished and all(len(o.token_ids) == 60 for o in finished)
            await blocks_back(client, NUM_BLOCKS)

    small_server.run(body())


def test_the_largest_priority_value_is_preempted_first_whenever_it_joined(
    small_server: DecodeServerThread, player: PrefillPlayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's priority (lower first) picks the request preempted, before when it joined:
    here the priority-1 request joins first and is still the one preempted (resuming held
    until the test has looked)."""
    asks = _fill(player, "rank", 50)
    priorities = [1, 0, 0]
    table = small_server.instance.table
    may_resume = _hold_resumes(table, monkeypatch)
    expected = [player.reference(prompt, params) for _, prompt, params in asks]

    async def body() -> None:
        async with insecure_channel(small_server.address) as channel:
            client = Client(channel)
            admitted = []
            for (request_id, prompt, params), priority in zip(asks, priorities, strict=True):
                request = decode_pb2.GenerateRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    sampling=sampling(params),
                    priority=priority,
                )
                admitted.append(await client.admit(request))
            first = asyncio.create_task(_transfer_and_collect(client, player, asks[0], admitted[0]))
            await eventually(lambda: table.get(asks[0][0]).state is RequestState.RUNNING)
            rest = [
                asyncio.create_task(_transfer_and_collect(client, player, ask, a))
                for ask, a in zip(asks[1:], admitted[1:], strict=True)
            ]
            await eventually(lambda: table.num_preempted > 0)
            assert [_is_preempted(table, a[0]) for a in asks] == [True, False, False]
            may_resume.set()
            outcomes = await asyncio.gather(first, *rest)
            assert [o.token_ids for o in outcomes] == expected
            await blocks_back(client, NUM_BLOCKS)

    small_server.run(body())


def test_a_request_cancelled_while_resuming_stops_computing_and_the_rest_finish(
    small_server: DecodeServerThread,
    player: PrefillPlayer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its K/V computed back a chunk an iteration, a request cancelled between two chunks
    ends there: its blocks come back and it is never said to have resumed."""
    monkeypatch.setattr(preemption, "RECOMPUTE_CHUNK_TOKENS", 8)
    asks = _fill(player, "halfway", 60)
    table = small_server.instance.table
    runner = small_server.instance.runner
    prefill = runner.prefill
    in_chunk, go_on = threading.Event(), threading.Event()
    chunked: list[list[int]] = []  # the block table of the first request computed back

    def first_chunk_held(chunks: Any, block_tables: Any, starts: Any, **kwargs: Any) -> Any:
        if not chunked:
            chunked.append(block_tables[0])
            in_chunk.set()
            assert go_on.wait(10), "the test never let the chunk go on"
        return prefill(chunks, block_tables, starts, **kwargs)

    monkeypatch.setattr(runner, "prefill", first_chunk_held)

    async def body() -> str:
        async with insecure_channel(small_server.address) as channel:
            client = Client(channel)
            admitted, runs = await _start_all(client, player, asks)
            await eventually(in_chunk.is_set, timeout_s=10)
            held = [table.get(a[0]) for a in asks]  # None: ended already
            victim = next(i for i, r in enumerate(held) if r and r.block_table is chunked[0])
            admitted[victim][0].cancel()  # type: ignore[attr-defined]
            await eventually(lambda: table.get(asks[victim][0]).is_cancelled)
            go_on.set()
            outcomes = await asyncio.gather(*runs, return_exceptions=True)
            assert isinstance(outcomes[victim], BaseException)
            kept = [o for i, o in enumerate(outcomes) if i != victim]
            assert all(isinstance(o, Outcome) and len(o.token_ids) == 60 for o in kept), kept
            await blocks_back(client, NUM_BLOCKS)
            return asks[victim][0]

    with caplog.at_level(logging.INFO, logger="mili.decode"):
        name = small_server.run(body())
    said = [r.getMessage() for r in caplog.records if f"'{name}'" in r.getMessage()]
    assert any("preempted after" in line for line in said), said
    assert not any(" resumed: " in line for line in said), said


def test_random_traffic_through_a_small_pool_loses_no_block_and_keeps_greedy_tokens(
    small_server: DecodeServerThread, player: PrefillPlayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paths together, as a frontend's traffic meets them: 16 requests arriving at random
    moments, of random lengths and priorities, refused while the pool is full or a request
    waits preempted and sent again (as the frontend does), some cancelled before their KV
    comes, some after a few tokens, some late in their run, some at a random moment (often
    while preempted or resuming). Every request run to its end gives the engine's greedy
    tokens, every block comes back, and the run preempted and resumed."""
    monkeypatch.setattr(preemption, "RECOMPUTE_CHUNK_TOKENS", 8)  # resumes of several chunks
    rng = random.Random(5)
    fates = ["finish"] * 4 + ["cancel before the KV", "cancel after a few", "cancel late"]
    fates += ["cancel at a moment"] * 2  # whatever it is doing then: often waiting preempted
    plans = []
    for i in range(16):
        num_prompt = rng.randint(4, 30)
        max_tokens = rng.randint(8, NUM_BLOCKS * BLOCK_SIZE + 1 - num_prompt)  # fits at its longest
        fate = rng.choice(fates)
        cancel_at = {"cancel after a few": rng.randint(1, 3), "cancel late": max_tokens - 2}
        cancel_s = rng.uniform(0.05, 0.5) if fate == "cancel at a moment" else None
        plans.append(
            (
                f"soak-{i}",
                random_prompt(num_prompt, player.vocab_size, 100 + i),
                dataclasses.replace(GREEDY, max_tokens=max_tokens),
                rng.randint(0, 2),  # priority
                rng.uniform(0, 0.3),  # when it arrives, s
                fate,
                cancel_at.get(fate),
                cancel_s,  # after its KV went, s
            )
        )
    expected = {
        plan[0]: player.reference(plan[1], plan[2]) for plan in plans if plan[5] == "finish"
    }
    batcher = small_server.instance.batcher
    preemptions = batcher.num_preemptions
    refusals: list[str] = []

    async def one(client: Client, plan: tuple[Any, ...]) -> list[int] | None:
        request_id, prompt, params, priority, arrives_s, fate, cancel_at, cancel_s = plan
        await asyncio.sleep(arrives_s)
        request = decode_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=sampling(params),
            priority=priority,
        )
        while True:
            try:
                call, reserved = await client.admit(request)
                break
            except grpc.aio.AioRpcError as e:  # full, or a request waits preempted
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                refusals.append(e.details() or "")
                await asyncio.sleep(0.02)
        if fate == "cancel before the KV":
            call.cancel()
            return None
        prefilled = await asyncio.to_thread(player.prefill, prompt, params)
        transfer = client.kv.TransferKv(timeout=30)
        for message in player.messages(request_id, prompt, reserved, prefilled):
            await transfer.write(message)
        await transfer.done_writing()
        await transfer
        if cancel_s is not None:
            asyncio.get_running_loop().call_later(cancel_s, call.cancel)
        tokens: list[int] = []
        try:
            while (response := await call.read()) is not grpc.aio.EOF:
                tokens.extend(response.tokens.token_ids)
                if cancel_at is not None and len(tokens) >= cancel_at:
                    call.cancel()
                    return None
        except asyncio.CancelledError:  # its moment came
            assert cancel_s is not None
            return None
        return None if cancel_s is not None else tokens

    async def body() -> None:
        async with insecure_channel(small_server.address) as channel:
            client = Client(channel)
            await client.info()
            outcomes = await asyncio.gather(*(one(client, plan) for plan in plans))
            finished = {
                plan[0]: tokens
                for plan, tokens in zip(plans, outcomes, strict=True)
                if plan[5] == "finish"
            }
            assert finished == expected
            await blocks_back(client, NUM_BLOCKS)

    small_server.run(body(), timeout_s=120)
    assert small_server.instance.table.num_preempted == 0
    assert batcher.num_preemptions - preemptions >= 2
    assert any("preempted request" in r for r in refusals), refusals


def _record_preemptions(table: RequestTable, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids of the requests preempted from now on, in order."""
    preempt = table.preempt
    preempted: list[str] = []

    def recorded(request: Any, *args: Any) -> int:
        preempted.append(request.request_id)
        return preempt(request, *args)

    monkeypatch.setattr(table, "preempt", recorded)
    return preempted


def _ask(
    player: PrefillPlayer, request_id: str, num_prompt: int, max_tokens: int, seed: int
) -> Any:
    prompt = random_prompt(num_prompt, player.vocab_size, seed)
    return request_id, prompt, dataclasses.replace(GREEDY, max_tokens=max_tokens)


def _request(ask: Any, priority: int) -> decode_pb2.GenerateRequest:
    request_id, prompt, params = ask
    return decode_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling(params), priority=priority
    )


def test_a_request_short_of_a_block_waits_for_one_admitted_after_it_rather_than_preempt_itself(
    small_server: DecodeServerThread, player: PrefillPlayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocks are all taken by a request admitted after it whose KV is still on its way:
    the running one (the only one) sits its steps out until that one joins, which is then the
    one preempted (it ranks after). It was preempting itself, and waited for the newcomer's
    whole run before it resumed."""
    first = _ask(player, "first", 20, 60, 60)  # 4 blocks at admission
    second = _ask(player, "second", 50, 40, 61)  # the other 8
    expected = [player.reference(prompt, params) for _, prompt, params in (first, second)]
    table = small_server.instance.table
    preempted = _record_preemptions(table, monkeypatch)

    async def body() -> None:
        async with insecure_channel(small_server.address) as channel:
            client = Client(channel)
            await client.info()
            admitted_first = await client.admit(_request(first, 0))
            admitted_second = await client.admit(_request(second, 1))
            assert (await client.info()).num_free_blocks == 0
            run_first = asyncio.create_task(
                _transfer_and_collect(client, player, first, admitted_first)
            )
            await eventually(lambda: table.get("first").state is RequestState.RUNNING)
            # its 13th output (position 32) needs a block the pool lacks: long before this
            await asyncio.sleep(0.5)
            assert not run_first.done() and not preempted, preempted
            assert len(table.get("first").block_table) == 4
            run_second = asyncio.create_task(
                _transfer_and_collect(client, player, second, admitted_second)
            )
            outcomes = await asyncio.gather(run_first, run_second)
            assert [o.token_ids for o in outcomes] == expected
            await blocks_back(client, NUM_BLOCKS)

    small_server.run(body())
    assert preempted[:1] == ["second"] and "first" not in preempted, preempted


def test_a_request_resuming_is_preempted_again_for_a_running_one_ranked_before_it(
    small_server: DecodeServerThread, player: PrefillPlayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its blocks were lent for its resume: when the running request ranked before it is a
    block short mid-resume (here a token a chunk, so the resume outlasts the spare block),
    the resuming one goes back to waiting, not the running one. It was preempting the running
    one (the last of the batch), a priority-0 request for a priority-1 one.

    The blocks come and go at the test's word: a request admitted and never sent its KV holds
    5 of the 12 until it is cancelled."""
    monkeypatch.setattr(preemption, "RECOMPUTE_CHUNK_TOKENS", 1)
    holder = _ask(player, "holder", 30, 8, 80)  # 5 blocks at admission
    long = _ask(player, "long", 10, 80, 81)  # 3 blocks at admission, 12 at its longest
    low = _ask(player, "low", 10, 60, 82)  # 3 blocks at admission; the one preempted
    expected = [player.reference(prompt, params) for _, prompt, params in (long, low)]
    table = small_server.instance.table
    preempted = _record_preemptions(table, monkeypatch)

    async def body() -> None:
        async with insecure_channel(small_server.address) as channel:
            client = Client(channel)
            await client.info()
            held, _ = await client.admit(_request(holder, 0))
            admitted = [await client.admit(_request(long, 0)), await client.admit(_request(low, 1))]
            runs = [
                asyncio.create_task(_transfer_and_collect(client, player, ask, a))
                for ask, a in zip((long, low), admitted, strict=True)
            ]
            # low preempted at position 24; long then grows to the pool's end (7 blocks) and
            # sits out, waiting for the holder to join
            await eventually(lambda: len(table.get("long").block_table) == 7)
            await asyncio.sleep(0.3)
            assert preempted == ["low"] and len(table.get("long").block_table) == 7
            held.cancel()  # 5 blocks back: low resumes (4 and a spare), long grows into them
            outcomes = await asyncio.gather(*runs)
            assert [o.token_ids for o in outcomes] == expected
            await blocks_back(client, NUM_BLOCKS)

    small_server.run(body())
    assert preempted == ["low", "low"], preempted
