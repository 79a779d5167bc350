"""Prefill in-process, the real decode service as a process: decode reserves, prefill streams the
KV into its blocks, decode's tokens equal single-process generation and both pools end full,
over every KV transport this host offers (shm: prefill writes decode's pool in shared memory;
grpc: forced by a flag, or because the two sides report different host ids)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from mili.engine.generate import generate
from mili.engine.sampling_params import SamplingParams
from mili.kv_handoff import checksums
from mili.kv_handoff.shm_segment import segments_of
from mili.pb.common.v1 import sampling_pb2
from mili.pb.decode.v1 import decode_pb2, decode_pb2_grpc
from mili.pb.prefill.v1 import prefill_pb2
from mili.rpc.client import insecure_channel
from tests.prefill.harness import (
    BLOCK_SIZE,
    TinyModel,
    prefill_request,
    prefill_service,
    random_ids,
)
from tests.service_process import ServiceProcess

NUM_TOKENS = 33


@pytest.fixture(scope="module")
def decode(tiny: TinyModel) -> Iterator[ServiceProcess]:
    process = ServiceProcess(
        "serve-decode",
        "--model",
        str(tiny.path),
        "--port",
        "0",
        "--block-size",
        str(BLOCK_SIZE),
        "--num-blocks",
        "64",
    )
    yield process
    pid = process.proc.pid
    assert process.terminate() == 0, process.stderr
    assert segments_of(pid) == []  # unlinked on exit


# (prefill's PrefillConfig overrides, the transport the pair must get)
TRANSPORTS = {
    "shm": ({}, "shm"),
    "grpc-forced": ({"kv_transport": "grpc"}, "grpc"),
    "other-host": ({"host_id": "another-host"}, "grpc"),
}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("num_tokens", [7, 150])  # one block; chunked by prefill (64 a forward)
def test_decode_continues_from_prefill_kv(
    tiny: TinyModel, decode: ServiceProcess, num_tokens: int, transport: str
) -> None:
    prefill_config, expected_transport = TRANSPORTS[transport]
    # A prompt of its own per transport: decode's prefix cache would otherwise hold an earlier
    # case's blocks, and this one would send less than the whole prompt over its transport.
    seed = 300 + num_tokens + 1000 * list(TRANSPORTS).index(transport)
    prompt = random_ids(num_tokens, tiny.model.config.vocab_size, seed=seed)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    expected = generate(tiny.model, [prompt], greedy)[0].token_ids
    request_id = f"with-decode-{num_tokens}-{transport}"

    async def main() -> list[int]:
        async with (
            prefill_service(tiny, **prefill_config) as prefill,
            insecure_channel(decode.address) as channel,
        ):
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            before = await stub.Info(decode_pb2.InfoRequest())
            stream = stub.Generate(
                decode_pb2.GenerateRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    sampling=sampling_pb2.SamplingParams(
                        temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True
                    ),
                    prefill_layout=prefill.servicer.layout,
                ),
                timeout=60,
            )
            events = aiter(stream)
            admitted = (await anext(events)).admitted
            request = prefill_request(
                request_id,
                prompt,
                decode.address,
                list(admitted.prompt_block_ids),
                admitted.transfer_token,
            )
            reply = await prefill.stub.Prefill(request, timeout=30)
            tokens: list[int] = []
            async for event in events:
                tokens.extend(event.tokens.token_ids)
            assert tokens[0] == reply.first_token_id
            after = await stub.Info(decode_pb2.InfoRequest())
            assert after.num_free_blocks == before.num_free_blocks
            assert list(after.kv_transports) == ["shm", "grpc"]
            info = await prefill.stub.Info(prefill_pb2.InfoRequest())
            assert dict(info.kv_transports) == {decode.address: expected_transport}
            # The fastest checksum both sides have (xxh3-64 where the xxhash package is).
            pairing = await prefill.servicer.peers.pair(decode.address)
            assert pairing.checksum == checksums.available()[0]
            return tokens

    try:
        tokens = asyncio.run(main())
    except grpc.aio.AioRpcError as err:  # pragma: no cover - shows decode's log on failure
        raise AssertionError(f"{err.code().name}: {err.details()}\n{decode.stderr}") from err
    assert tokens == expected
    assert len(segments_of(decode.proc.pid)) == 1  # decode's pool, mapped once


def test_second_turn_sends_only_the_blocks_decode_lacks(
    tiny: TinyModel, decode: ServiceProcess
) -> None:
    """Turn 2 resends turn 1's prompt and answer: decode holds their full blocks from turn 1,
    prefill sends the rest only, and decode's tokens still equal single-process generation."""
    vocab = tiny.model.config.vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    first_prompt = random_ids(40, vocab, seed=401)
    first_answer = generate(tiny.model, [first_prompt], greedy)[0].token_ids
    second_prompt = first_prompt + first_answer + random_ids(10, vocab, seed=402)  # 83 tokens
    expected = generate(tiny.model, [second_prompt], greedy)[0].token_ids

    async def turn(
        prefill: object, stub: decode_pb2_grpc.DecodeServiceStub, rid: str, prompt: list[int]
    ) -> tuple[list[int], int, int]:
        stream = stub.Generate(
            decode_pb2.GenerateRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling=sampling_pb2.SamplingParams(
                    temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True
                ),
                prefill_layout=prefill.servicer.layout,  # type: ignore[attr-defined]
            ),
            timeout=60,
        )
        events = aiter(stream)
        admitted = (await anext(events)).admitted
        request = prefill_request(
            rid, prompt, decode.address, list(admitted.prompt_block_ids), admitted.transfer_token
        )
        request.destination.num_cached_blocks = admitted.num_cached_blocks
        reply = await prefill.stub.Prefill(request, timeout=30)  # type: ignore[attr-defined]
        tokens: list[int] = []
        async for event in events:
            tokens.extend(event.tokens.token_ids)
        return tokens, admitted.num_cached_blocks, reply.kv_bytes

    async def main() -> None:
        async with (
            prefill_service(tiny) as prefill,
            insecure_channel(decode.address) as channel,
        ):
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            before = (await stub.Info(decode_pb2.InfoRequest())).prefix_cache
            tokens, cached, kv_bytes_1 = await turn(prefill, stub, "turn-1", first_prompt)
            assert tokens == first_answer and cached == 0
            tokens, cached, kv_bytes_2 = await turn(prefill, stub, "turn-2", second_prompt)
            assert tokens == expected
            # Decode wrote K/V for 40 + 32 tokens in turn 1 (the last answer token is never fed
            # back): 4 full blocks of 16, all inside turn 2's 83-token prompt.
            assert cached == 4
            per_block = kv_bytes_1 // 3  # turn 1 sent its 3 prompt blocks
            assert kv_bytes_2 == per_block * (6 - 4)  # 83 tokens = 6 blocks, 4 held
            after = (await stub.Info(decode_pb2.InfoRequest())).prefix_cache
            assert after.enabled
            assert after.hit_tokens - before.hit_tokens == 4 * BLOCK_SIZE
            assert after.query_tokens - before.query_tokens == 40 + 83
            assert after.num_cached_blocks >= 4
            # prefill had turn 1's 2 full prompt blocks and computed the rest of turn 2
            info = (await prefill.stub.Info(prefill_pb2.InfoRequest())).prefix_cache
            assert (info.hit_tokens, info.query_tokens) == (2 * BLOCK_SIZE, 123)
            assert info.enabled and info.num_cached_blocks == 5  # turn 2's full blocks, 2 shared

    try:
        asyncio.run(main())
    except grpc.aio.AioRpcError as err:  # pragma: no cover - shows decode's log on failure
        raise AssertionError(f"{err.code().name}: {err.details()}\n{decode.stderr}") from err


def test_a_prompt_refused_for_prefill_room_leaves_decode_waiting_and_whole(
    tiny: TinyModel, decode: ServiceProcess
) -> None:
    """Issue 29 against real decode: two prompts at once on a prefill with queue room for one.
    The one refused is RESOURCE_EXHAUSTED before any KV moves, so decode's request is not
    failed as if prefill had gone away: it waits for its KV until its caller cancels it, and
    then decode's blocks all come back. The other prompt generates."""
    vocab = tiny.model.config.vocab_size
    prompts = {"room-a": random_ids(40, vocab, seed=501), "room-b": random_ids(40, vocab, seed=502)}
    sampling = sampling_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def main() -> None:
        async with (
            prefill_service(tiny, max_queued_tokens=64) as prefill,
            insecure_channel(decode.address) as channel,
        ):
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            before = await stub.Info(decode_pb2.InfoRequest())
            streams, requests = {}, {}
            for rid, prompt in prompts.items():
                streams[rid] = stub.Generate(
                    decode_pb2.GenerateRequest(
                        request_id=rid,
                        prompt_token_ids=prompt,
                        sampling=sampling,
                        prefill_layout=prefill.servicer.layout,
                    ),
                    timeout=60,
                )
                admitted = (await streams[rid].read()).admitted
                requests[rid] = prefill_request(
                    rid,
                    prompt,
                    decode.address,
                    list(admitted.prompt_block_ids),
                    admitted.transfer_token,
                )
            # Both calls past pairing together: both reach the queue bound before either has
            # submitted its prompt.
            peers = prefill.servicer.peers
            pair, arrived = peers.pair, asyncio.Barrier(2)

            async def pair_together(address: str) -> Any:
                await arrived.wait()
                return await pair(address)

            peers.pair = pair_together  # type: ignore[method-assign]
            results = await asyncio.gather(
                *(prefill.stub.Prefill(r, timeout=30) for r in requests.values()),
                return_exceptions=True,
            )
            outcomes = dict(zip(requests, results, strict=True))
            (refused,) = [r for r, o in outcomes.items() if isinstance(o, grpc.aio.AioRpcError)]
            error = outcomes[refused]
            assert isinstance(error, grpc.aio.AioRpcError)
            assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
            (winner,) = set(prompts) - {refused}
            tokens = []
            while (event := await streams[winner].read()) is not grpc.aio.EOF:
                tokens.extend(event.tokens.token_ids)
            assert len(tokens) == 4
            # decode heard nothing of the refused prompt's KV: it still waits, no error
            waiting = asyncio.ensure_future(streams[refused].read())
            done, _ = await asyncio.wait({waiting}, timeout=0.3)
            assert not done
            streams[refused].cancel()  # what the frontend does with prefill's refusal
            await asyncio.wait({waiting}, timeout=5)
            if waiting.done() and not waiting.cancelled():
                waiting.exception()  # retrieved: the read ends with the cancelled call
            deadline = time.monotonic() + 5
            while (await stub.Info(decode_pb2.InfoRequest())).num_free_blocks != (
                before.num_free_blocks
            ):
                assert time.monotonic() < deadline, "decode's blocks did not come back"
                await asyncio.sleep(0.05)

    try:
        asyncio.run(main())
    except grpc.aio.AioRpcError as err:  # pragma: no cover - shows decode's log on failure
        raise AssertionError(f"{err.code().name}: {err.details()}\n{decode.stderr}") from err


def test_decode_process_killed_mid_shm_transfer_leaves_no_segment(tiny: TinyModel) -> None:
    """Decode dies while prefill writes into its shared pool: the Prefill call fails
    UNAVAILABLE within seconds, prefill's blocks come back (prefill_service checks), and the
    dead decode's segment is gone from /dev/shm (prefill drops its mapping and unlinks it)."""
    decode = ServiceProcess(
        "serve-decode", "--model", str(tiny.path), "--port", "0",
        "--block-size", str(BLOCK_SIZE), "--num-blocks", "64",
    )  # fmt: skip
    pid = decode.proc.pid
    try:
        assert len(segments_of(pid)) == 1
        prompt = random_ids(150, tiny.model.config.vocab_size, seed=5)
        sampling = sampling_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

        async def main() -> grpc.aio.AioRpcError:
            async with (
                prefill_service(tiny) as prefill,
                insecure_channel(decode.address) as channel,
            ):
                stub = decode_pb2_grpc.DecodeServiceStub(channel)

                async def admit(request_id: str) -> decode_pb2.Admitted:
                    stream = stub.Generate(
                        decode_pb2.GenerateRequest(
                            request_id=request_id,
                            prompt_token_ids=prompt,
                            sampling=sampling,
                            prefill_layout=prefill.servicer.layout,
                        ),
                        timeout=60,
                    )
                    return (await anext(aiter(stream))).admitted

                # A first request pairs the two over shm.
                first = await admit("paired")
                await prefill.stub.Prefill(
                    prefill_request(
                        "paired", prompt, decode.address,
                        list(first.prompt_block_ids), first.transfer_token,
                    ),
                    timeout=30,
                )  # fmt: skip
                info = await prefill.stub.Info(prefill_pb2.InfoRequest())
                assert dict(info.kv_transports) == {decode.address: "shm"}
                victim = await admit("victim")
                decode.proc.send_signal(signal.SIGSTOP)  # holds the transfer mid-way
                call = prefill.stub.Prefill(
                    prefill_request(
                        "victim", prompt, decode.address,
                        list(victim.prompt_block_ids), victim.transfer_token,
                    ),
                    timeout=30,
                )  # fmt: skip
                await asyncio.sleep(0.5)
                killed_at = time.monotonic()
                decode.proc.kill()
                with pytest.raises(grpc.aio.AioRpcError) as info_err:
                    await call
                assert time.monotonic() - killed_at < 5
                deadline = time.monotonic() + 5
                while segments_of(pid) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                info = await prefill.stub.Info(prefill_pb2.InfoRequest())
                assert dict(info.kv_transports) == {}  # the pair is forgotten
                return info_err.value

        err = asyncio.run(main())
        assert err.code() is grpc.StatusCode.UNAVAILABLE, err.details()
        assert segments_of(pid) == []
    finally:
        decode.proc.kill()
        decode.proc.wait()


def test_decode_killed_between_transfers_loses_its_segment(tiny: TinyModel) -> None:
    """No transfer fails to tell prefill, yet its sweep notices the owner is gone."""
    decode = ServiceProcess(
        "serve-decode", "--model", str(tiny.path), "--port", "0",
        "--block-size", str(BLOCK_SIZE), "--num-blocks", "64",
    )  # fmt: skip
    pid = decode.proc.pid
    try:

        async def main() -> None:
            async with prefill_service(tiny) as prefill:
                pairing = await prefill.servicer.peers.pair(decode.address)
                assert pairing.transport == "shm"
                decode.proc.kill()
                await asyncio.to_thread(decode.proc.wait)
                # Another process's sweep may unlink the segment first: wait for ours too.
                peers = prefill.servicer.peers
                deadline = time.monotonic() + 5
                while (segments_of(pid) or peers.transports()) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert peers.transports() == {}

        asyncio.run(main())
        assert segments_of(pid) == []
    finally:
        decode.proc.kill()
        decode.proc.wait()


def test_decode_forced_to_grpc_has_no_segment(tiny: TinyModel) -> None:
    decode = ServiceProcess(
        "serve-decode", "--model", str(tiny.path), "--port", "0",
        "--block-size", str(BLOCK_SIZE), "--num-blocks", "64", "--kv-transport", "grpc",
    )  # fmt: skip
    try:
        assert segments_of(decode.proc.pid) == []

        async def main() -> str:
            async with prefill_service(tiny) as prefill:
                return (await prefill.servicer.peers.pair(decode.address)).transport

        assert asyncio.run(main()) == "grpc"
    finally:
        assert decode.terminate() == 0, decode.stderr
