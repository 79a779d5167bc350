"""The pipelined KV receiver: chunks land on worker threads while the stream is read on, with
bounded memory, failures seen at once, and no block freed while a chunk is landing in it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch

from mili.decode.v1 import decode_pb2
from mili.engine.block_rows import fits, write_blocks
from mili.engine.kv_cache import KVCache
from mili.engine.sampling_params import SamplingParams
from mili.errors import DataLoss
from mili.rpc.client import insecure_channel
from services.decode.landing import Landing
from tests.decode.conftest import NUM_BLOCKS, TINY
from tests.decode.harness import (
    Client,
    DecodeServerThread,
    Outcome,
    PrefillPlayer,
    blocks_back,
    random_prompt,
    sampling,
)

Code = grpc.StatusCode
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


# ---- _Landing: bounded, failures first ---------------------------------------------------------


def _gated_job(gate: threading.Event, started: list[int], i: int) -> Callable[[], None]:
    def job() -> None:
        started.append(i)
        assert gate.wait(5)

    return job


def test_landing_bounds_the_bytes_in_flight() -> None:
    async def main() -> None:
        with ThreadPoolExecutor(4) as pool:
            landing = Landing(pool, max_bytes=10)
            gate, started = threading.Event(), list[int]()
            await landing.make_room(6)
            landing.submit(_gated_job(gate, started, 0), 6)
            room = asyncio.ensure_future(landing.make_room(6))  # 6 + 6 > 10: waits
            await asyncio.sleep(0.1)
            assert not room.done()
            gate.set()
            await asyncio.wait_for(room, 5)
            landing.submit(_gated_job(gate, started, 1), 6)
            await asyncio.wait_for(landing.wait_all(), 5)
            assert started == [0, 1]
            # A chunk larger than the bound still goes, alone.
            await asyncio.wait_for(landing.make_room(100), 1)

    asyncio.run(main())


def test_landing_failure_is_seen_at_once_and_later_jobs_can_skip() -> None:
    async def main() -> None:
        with ThreadPoolExecutor(1) as pool:
            landing = Landing(pool, max_bytes=100)
            skipped, done = list[bool](), threading.Event()

            def bad() -> None:
                raise DataLoss("chunk 0: checksum mismatch")

            def later() -> None:
                skipped.append(landing.is_aborted())
                done.set()

            landing.submit(bad, 1)
            await asyncio.wait_for(asyncio.wait({landing.failed}), 5)
            with pytest.raises(DataLoss, match="checksum"):
                await landing.make_room(1)
            with pytest.raises(DataLoss, match="checksum"):
                await landing.wait_all()
            landing.abort()
            landing.submit(later, 1)
            assert await asyncio.to_thread(done.wait, 5)
            assert skipped == [True]

    asyncio.run(main())


# ---- the fast CPU scatter ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_row_copy_is_bit_exact_like_scatter_blocks(dtype: torch.dtype) -> None:
    reference = KVCache(TINY, 16, 4, dtype=dtype)
    fast = KVCache(TINY, 16, 4, dtype=dtype)
    ids = [9, 2, 3, 15, 0]
    shape = (len(ids), *reference.k[1].shape[1:])
    g = torch.Generator().manual_seed(0)
    # Random bit patterns, NaN payloads included: the copy must not touch a single bit.
    k = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=g)
    k = k.to(torch.uint8).view(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    reference.scatter_blocks(1, ids, k, v)
    for dst, src in ((fast.k[1], k), (fast.v[1], v)):
        assert fits(dst, ids, src)
        write_blocks(dst, ids, src)
    for a, b in ((reference.k, fast.k), (reference.v, fast.v)):
        for layer in range(TINY.num_hidden_layers):
            assert torch.equal(a[layer].view(torch.uint8), b[layer].view(torch.uint8))


def test_row_copy_declines_what_scatter_blocks_must_handle() -> None:
    cache = KVCache(TINY, 16, 4, dtype=torch.float32)
    dst = cache.k[0]
    good = torch.zeros(2, *dst.shape[1:])
    assert fits(dst, [1, 2], good)
    assert fits(dst, [], good[:0])
    assert not fits(dst, [1, 2], good.double())  # dtype conversion
    assert not fits(dst, [1], good)  # shape
    assert not fits(dst, [1, 16], good)  # out of range
    assert not fits(dst, [-1, 2], good)  # numpy would wrap around
    assert not fits(dst, [1, 2], good.transpose(1, 2).contiguous().transpose(1, 2))


# ---- the receiver in a decode server -----------------------------------------------------------


class GatedScatter:
    """Stands in for Batcher.scatter: the chunk of `layer` waits for `release` before landing."""

    def __init__(self, real: Callable[..., None], layer: int) -> None:
        self.real, self.layer = real, layer
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, layer: int, *args: Any) -> None:
        if layer == self.layer:
            self.entered.set()
            assert self.release.wait(10)
        self.real(layer, *args)


@pytest.fixture
def gated(decode_server: DecodeServerThread, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    batcher = decode_server.instance.batcher

    def gate(layer: int) -> GatedScatter:
        scatter = GatedScatter(batcher.scatter, layer)
        monkeypatch.setattr(batcher, "scatter", scatter)
        return scatter

    yield gate
    if isinstance(batcher.scatter, GatedScatter):
        batcher.scatter.release.set()  # a failed test must not leave a landing thread stuck


def run(server: DecodeServerThread, body: Callable[[Client], Any]) -> None:
    async def main() -> None:
        async with insecure_channel(server.address) as channel:
            client = Client(channel)
            assert (await client.info()).num_free_blocks == NUM_BLOCKS
            await body(client)
            await blocks_back(client, NUM_BLOCKS)

    server.run(main())


def generate_request(request_id: str, prompt: list[int]) -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling(SHORT)
    )


def test_blocks_stay_held_while_a_chunk_lands_after_the_caller_left(
    decode_server: DecodeServerThread, player: PrefillPlayer, gated: Any
) -> None:
    prompt = random_prompt(13, player.vocab_size, seed=30)
    scatter = gated(0)

    async def body(client: Client) -> None:
        call, block_ids = await client.admit(generate_request("mid-scatter", prompt))
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        messages = player.messages("mid-scatter", prompt, block_ids, prefilled)
        transfer = client.kv.TransferKv(timeout=10)
        await transfer.write(messages[0])
        await transfer.write(messages[1])  # layer 0: lands until released
        assert await asyncio.to_thread(scatter.entered.wait, 5)
        held = (await client.info()).num_free_blocks
        assert held < NUM_BLOCKS
        call.cancel()  # the caller goes away mid-copy: the transfer ends now, not after it
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(transfer, 5)
        assert err.value.code() == Code.CANCELLED, err.value.details()
        info = await client.info()
        assert info.num_waiting == 0  # the request is gone...
        assert info.num_free_blocks == held  # ...but its blocks wait for the copy
        scatter.release.set()

    run(decode_server, body)


def test_commit_waits_for_every_chunk_to_land(
    decode_server: DecodeServerThread, player: PrefillPlayer, gated: Any
) -> None:
    prompt = random_prompt(13, player.vocab_size, seed=31)
    scatter = gated(TINY.num_hidden_layers - 1)  # the last chunk

    async def body(client: Client) -> None:
        call, block_ids = await client.admit(generate_request("slow-land", prompt))
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        messages = player.messages("slow-land", prompt, block_ids, prefilled)
        transfer = client.kv.TransferKv(timeout=10)
        for message in messages:
            await transfer.write(message)
        await transfer.done_writing()
        assert await asyncio.to_thread(scatter.entered.wait, 5)
        await asyncio.sleep(0.2)
        assert not transfer.done()  # the commit is held until the last chunk landed
        assert (await client.info()).num_running == 0
        scatter.release.set()
        reply = await asyncio.wait_for(transfer, 5)
        assert reply.num_blocks == len(block_ids)
        outcome = await client.collect(call, Outcome(block_ids=block_ids))
        assert outcome.token_ids == player.reference(prompt, SHORT)

    run(decode_server, body)


def test_a_corrupt_chunk_fails_the_transfer_while_the_sender_is_quiet(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    prompt = random_prompt(13, player.vocab_size, seed=32)

    async def body(client: Client) -> None:
        call, block_ids = await client.admit(generate_request("quiet", prompt))
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        messages = player.messages("quiet", prompt, block_ids, prefilled)
        chunk = messages[1].chunk
        chunk.crc32 ^= 1
        transfer = client.kv.TransferKv(timeout=10)
        await transfer.write(messages[0])
        await transfer.write(messages[1])
        # No further chunk, no commit, the stream open: decode reports at once all the same.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(transfer, 5)
        assert err.value.code() == Code.DATA_LOSS
        assert "request 'quiet' chunk 0 (layer 0): checksum mismatch" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == Code.DATA_LOSS

    run(decode_server, body)
