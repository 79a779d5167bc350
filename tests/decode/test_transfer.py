"""The pipelined KV receiver: chunks land on worker threads while the stream is read on, with
bounded memory, failures seen at once, and no block freed while a chunk is landing in it."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from mili.engine.model.kv_cache import KVCache
from mili.engine.sampling_params import SamplingParams
from mili.errors import DataLoss, FailedPrecondition
from mili.kv_handoff import checksums, kv_transport
from mili.kv_handoff.block_rows import fits, write_blocks
from mili.kv_handoff.codec import batch_in_place
from mili.kv_handoff.transport import ShmTransport
from mili.pb.decode.v1 import decode_pb2
from mili.pb.kv.v1 import kv_pb2
from mili.rpc.client import insecure_channel
from mili.rpc.server_config import ServerConfig
from services.decode import transfer as transfer_module
from services.decode.landing import Landing, Reader
from services.decode.transfer import _IN_PLACE_DRAIN_S, _IN_PLACE_GRACE_S, KvTransferServicer
from services.prefill import sender as sender_module
from services.prefill.pairing import Peers
from services.prefill.sender import KvSender
from services.prefill.task import FirstToken, PrefillTask
from tests.decode.conftest import NUM_BLOCKS, TINY, tiny_decode_config
from tests.decode.harness import (
    Client,
    DecodeServerThread,
    Outcome,
    Prefilled,
    PrefillPlayer,
    Reserved,
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
@pytest.mark.parametrize(
    "ids",
    [[9, 2, 3, 15, 0], [4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 0, 1, 2, 3, 7]],
    ids=["scattered", "one run", "runs"],  # a fancy-indexed copy, then one copy per run
)
def test_row_copy_is_bit_exact_like_scatter_blocks(dtype: torch.dtype, ids: list[int]) -> None:
    reference = KVCache(TINY, 16, 4, dtype=dtype)
    fast = KVCache(TINY, 16, 4, dtype=dtype)
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
    writer = decode_server.instance.kv_writer

    def gate(layer: int) -> GatedScatter:
        scatter = GatedScatter(writer.scatter, layer)
        monkeypatch.setattr(writer, "scatter", scatter)
        return scatter

    yield gate
    if isinstance(writer.scatter, GatedScatter):
        writer.scatter.release.set()  # a failed test must not leave a landing thread stuck


def run(server: DecodeServerThread, body: Callable[[Client], Any]) -> None:
    async def main() -> None:
        async with insecure_channel(server.address) as channel:
            client = Client(channel)
            assert (await client.info()).num_free_blocks == NUM_BLOCKS
            await body(client)
            # A failed in-place transfer's blocks come back _IN_PLACE_GRACE_S after it ends (a
            # stale copy may still be landing): wait that long and then the usual 2 s.
            await blocks_back(client, NUM_BLOCKS, timeout_s=_IN_PLACE_GRACE_S + 2.0)

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


# ---- in-place chunks announced several per message (TransferKvRequest.chunks) ----------------


def in_place_messages(
    server: DecodeServerThread,
    player: PrefillPlayer,
    request_id: str,
    prompt: list[int],
    block_ids: Reserved,
    prefilled: Prefilled,
    groups: list[list[int]],
    *,
    transport: str = kv_transport.SHM,
) -> list[kv_pb2.TransferKvRequest]:
    """header, the layers' chunks written into decode's shm pool as a paired prefill writes
    them (ShmTransport.encode) and announced in `groups` of seqs (a group of one: a lone chunk
    message, else one TransferKvRequest.chunks), commit."""
    instance = server.instance
    if instance.segment is None:
        pytest.skip("this host gave decode no shared-memory pool")
    cache = instance.cache
    # never closed: the segment is decode's
    pool = ShmTransport(instance.segment, cache.layout, cache.num_blocks, cache.dtype)
    checksum = checksums.available()[0]
    encoded = [
        pool.encode(request_id, layer, layer, list(block_ids), k, v, checksum)[0]
        for layer, (k, v) in enumerate(prefilled.kv)
    ]
    header = kv_pb2.TransferHeader(
        request_id=request_id,
        layout=player.layout(),
        num_tokens=len(prompt),
        num_chunks=len(encoded),
        transfer_token=block_ids.transfer_token,
        transport="" if transport == kv_transport.GRPC else transport,
        checksum="" if checksum == checksums.CRC32 else checksum,
    )
    announcements = [
        kv_pb2.TransferKvRequest.FromString(
            encoded[group[0]] if len(group) == 1 else batch_in_place([encoded[s] for s in group])
        )
        for group in groups
    ]
    commit = kv_pb2.TransferCommit(first_token_id=prefilled.first_token_id)
    return [
        kv_pb2.TransferKvRequest(header=header),
        *announcements,
        kv_pb2.TransferKvRequest(commit=commit),
    ]


@pytest.mark.parametrize("checks_on_device", [False, True])
def test_in_place_chunks_announced_together_land_and_decode_goes_on(
    decode_server: DecodeServerThread,
    player: PrefillPlayer,
    monkeypatch: pytest.MonkeyPatch,
    checks_on_device: bool,
) -> None:
    """A batch of two in-place chunks is checked by two landing jobs (one per landing thread,
    side by side), neither counted against the landing byte bound (the bytes are in the pool
    already); by one job where the transport checks on the device (cuda-ipc: each job would
    pay its own launches and read back). Decode then generates the reference tokens."""
    if checks_on_device:  # shm's checks, landed as cuda-ipc's are
        monkeypatch.setattr(ShmTransport, "takes_device_tensors", True)
    jobs: list[int] = []  # bytes each landing job was accounted
    submit = Landing.submit

    def spy(self: Landing, job: Callable[[], None], num_bytes: int) -> None:
        jobs.append(num_bytes)
        submit(self, job, num_bytes)

    monkeypatch.setattr(Landing, "submit", spy)
    prompt = random_prompt(21, player.vocab_size, seed=46 if checks_on_device else 40)
    request_id = f"batched-{checks_on_device}"
    layers = list(range(TINY.num_hidden_layers))
    assert len(layers) >= 2, "the test wants a batch of several chunks"
    groups = [layers[:2], *([layer] for layer in layers[2:])]

    async def body(client: Client) -> None:
        call, block_ids = await client.admit(generate_request(request_id, prompt))
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        messages = in_place_messages(
            decode_server, player, request_id, prompt, block_ids, prefilled, groups
        )
        assert messages[1].WhichOneof("kind") == "chunks"
        assert [c.seq for c in messages[1].chunks.chunks] == [0, 1]
        transfer = client.kv.TransferKv(timeout=10)
        for message in messages:
            await transfer.write(message)
        await transfer.done_writing()
        reply = await asyncio.wait_for(transfer, 5)
        assert reply.num_blocks == len(block_ids)
        assert jobs == [0] * ((1 if checks_on_device else 2) + len(layers[2:]))
        outcome = await client.collect(call, Outcome(block_ids=list(block_ids)))
        assert outcome.token_ids == player.reference(prompt, SHORT)

    run(decode_server, body)


@pytest.mark.parametrize("is_complete", [True, False])
def test_a_commit_inside_the_last_chunk_batch_commits_once_they_landed(
    decode_server: DecodeServerThread, player: PrefillPlayer, is_complete: bool
) -> None:
    """KvChunks.commit: an in-place transfer's last chunks and its commit in one message.
    Decode lands the chunks, then commits (the tokens are the single-process ones, the blocks
    go back after); a batch with the commit that leaves chunks out is DATA_LOSS, as a
    commit message after them would be."""
    prompt = random_prompt(19, player.vocab_size, seed=44 if is_complete else 47)
    layers = list(range(TINY.num_hidden_layers))
    request_id = f"commit-in-batch-{is_complete}"

    async def body(client: Client) -> None:
        free = (await client.info()).num_free_blocks
        call, block_ids = await client.admit(generate_request(request_id, prompt))
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        groups = [[layer] for layer in layers]  # lone chunks: the last one then in a batch
        header, *announced, commit = in_place_messages(
            decode_server, player, request_id, prompt, block_ids, prefilled, groups
        )
        if not is_complete:
            announced = announced[:-1]  # the second-to-last chunk ends the transfer
        last = announced.pop().chunk
        batch = kv_pb2.KvChunks(chunks=[last], commit=commit.commit)
        batches = [*announced, kv_pb2.TransferKvRequest(chunks=batch)]
        transfer = client.kv.TransferKv(timeout=10)
        for message in (header, *batches):
            await transfer.write(message)
        await transfer.done_writing()
        if is_complete:
            reply = await asyncio.wait_for(transfer, 5)
            assert reply.num_blocks == len(block_ids)
            outcome = await client.collect(call, Outcome(block_ids=list(block_ids)))
            assert outcome.token_ids == player.reference(prompt, SHORT)
        else:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(transfer, 5)
            assert err.value.code() == Code.DATA_LOSS, err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await asyncio.wait_for(call.read(), 5)
            assert failed.value.code() == Code.DATA_LOSS
        await blocks_back(client, free)

    run(decode_server, body)


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("grpc transfer", "a chunk batch in a grpc transfer"),
        ("chunk repeated in its batch", "expected chunk 1 (chunk lost, duplicated or reordered)"),
        ("corrupt chunk in a batch", "chunk 1 (layer 1): checksum mismatch (blocks corrupted"),
        ("empty batch", "a chunks message without a chunk"),  # once a ValueError: INTERNAL
    ],
)
def test_a_bad_chunk_batch_is_data_loss(
    decode_server: DecodeServerThread, player: PrefillPlayer, case: str, error: str
) -> None:
    prompt = random_prompt(13, player.vocab_size, seed=41)
    layers = list(range(TINY.num_hidden_layers))
    request_id = f"bad-batch-{len(case)}"

    async def body(client: Client) -> None:
        call, block_ids = await client.admit(generate_request(request_id, prompt))
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        groups = [[0, 0, *layers[1:]]] if case == "chunk repeated in its batch" else [layers]
        transport = kv_transport.GRPC if case == "grpc transfer" else kv_transport.SHM
        messages = in_place_messages(
            decode_server,
            player,
            request_id,
            prompt,
            block_ids,
            prefilled,
            groups,
            transport=transport,
        )
        if case == "empty batch":
            empty = kv_pb2.TransferKvRequest(chunks=kv_pb2.KvChunks())
            messages = [messages[0], empty, *messages[1:]]
        if case == "corrupt chunk in a batch":
            chunk = messages[1].chunks.chunks[1]
            chunk.xxh3_64 ^= 1
            chunk.crc32 ^= 0 if chunk.xxh3_64 else 1
        transfer = client.kv.TransferKv(timeout=10)
        for message in messages[:-1]:  # no commit: the request must fail without one
            await transfer.write(message)
        # The request fails at once; the call answers once the sender stopped writing (an
        # in-place sender may be inside a copy into the blocks: decode drains it).
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call.read(), 5)
        assert err.value.code() == Code.DATA_LOSS, err.value.details()
        assert error in err.value.details()
        await transfer.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(transfer, 5)
        assert err.value.code() == Code.DATA_LOSS, err.value.details()
        assert error in err.value.details()

    run(decode_server, body)


def test_an_in_place_sender_that_aborts_gets_its_blocks_freed_at_once(
    decode_server: DecodeServerThread, player: PrefillPlayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: every in-place transfer that ended without a commit held its blocks
    _IN_PLACE_GRACE_S (2 s) after the request's end, a cancelled one too. A sender that
    aborts and closes its side has no copy under way (it sends the abort only once its copies
    are over): its blocks come back at once."""
    monkeypatch.setattr(transfer_module, "_IN_PLACE_GRACE_S", 60.0)  # would hold them past the test
    prompt = random_prompt(13, player.vocab_size, seed=78)

    async def body(client: Client) -> None:
        call, block_ids = await client.admit(generate_request("aborted-shm", prompt))
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        messages = in_place_messages(
            decode_server, player, "aborted-shm", prompt, block_ids, prefilled, [[0]]
        )
        transfer = client.kv.TransferKv(timeout=10)
        await transfer.write(messages[0])  # the header, accepted
        await transfer.write(messages[1])  # a chunk
        abort = kv_pb2.TransferAbort(code=grpc.StatusCode.CANCELLED.value[0], message="gone")
        await transfer.write(kv_pb2.TransferKvRequest(abort=abort))
        await transfer.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call.read(), 5)
        assert err.value.code() == Code.CANCELLED, err.value.details()
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(transfer, 5)
        await blocks_back(client, NUM_BLOCKS, timeout_s=5.0)

    run(decode_server, body)


def test_a_quiet_in_place_sender_does_not_hold_the_blocks_past_the_request(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    """The request's lease passes while its in-place sender, accepted, writes nothing more
    (still computing, or hung) and sets no deadline: decode fails the request at once and
    ends the call itself soon after (the sender then stops before its next chunk), so the
    blocks come back _IN_PLACE_GRACE_S later, not whenever the sender gets round to closing."""
    prompt = random_prompt(13, player.vocab_size, seed=77)

    async def body(client: Client) -> None:
        request = generate_request("quiet-shm", prompt)
        request.kv_lease_ms = 300
        call, block_ids = await client.admit(request)
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        messages = in_place_messages(
            decode_server, player, "quiet-shm", prompt, block_ids, prefilled, [[0]]
        )
        transfer = client.kv.TransferKv()  # no deadline
        await transfer.write(messages[0])  # the header, accepted; then nothing
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call.read(), 5)
        assert err.value.code() == Code.DEADLINE_EXCEEDED, err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the sender never closed
            await asyncio.wait_for(transfer, _IN_PLACE_DRAIN_S + 3.0)
        assert err.value.code() == Code.DEADLINE_EXCEEDED, err.value.details()
        # run() then waits _IN_PLACE_GRACE_S + 2 s for every block to be back

    run(decode_server, body)


class SecondJobFirst(ThreadPoolExecutor):
    """Two encoder threads where the first job waits until the second one is over: both
    chunks are encoded by the time the sender can write the first."""

    def __init__(self) -> None:
        super().__init__(2)
        self._second_done = threading.Event()
        self._num_jobs = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        self._num_jobs += 1
        if self._num_jobs == 1:

            def first() -> Any:
                assert self._second_done.wait(5)
                return fn(*args, **kwargs)

            return super().submit(first)

        def later() -> Any:
            try:
                return fn(*args, **kwargs)
            finally:
                self._second_done.set()

        return super().submit(later)


def spy_landings(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The seqs of the chunks each `_land` call of decode's servicer gets, call by call."""
    landed: list[list[int]] = []
    land = KvTransferServicer._land

    async def spy(self: Any, progress: Any, landing: Any, chunks: list[Any]) -> None:
        landed.append([chunk.seq for chunk in chunks])
        await land(self, progress, landing, chunks)

    monkeypatch.setattr(KvTransferServicer, "_land", spy)
    return landed


async def send_over_shm(
    server: DecodeServerThread,
    player: PrefillPlayer,
    request_id: str,
    prompt: list[int],
    block_ids: Reserved,
    prefilled: Prefilled,
    chunks: list[tuple[int, int, torch.Tensor, torch.Tensor]],
    encoder: ThreadPoolExecutor,
) -> int:
    """Pair with decode as a prefill instance does (shm, chunk batches), send `chunks`
    ((layer, first block, k, v), all handed over at once) and the commit through a real
    KvSender encoding on `encoder` (two threads); return the KV bytes sent."""
    instance = server.instance
    peers = Peers(
        64 << 20, endpoint=instance.endpoint, layout=player.layout(), dtype=instance.cache.dtype
    )
    try:
        pairing = await peers.pair(server.address)
        assert pairing.transport == kv_transport.SHM
        task = PrefillTask(
            request_id,
            prompt,
            SHORT,
            server.address,
            list(block_ids),
            transfer_token=block_ids.transfer_token,
        )
        sender = KvSender(
            task,
            channel=peers.get(server.address),
            encoder=encoder,
            layout=player.layout(),
            num_chunks=len(chunks),
            timeout_s=10,
            pairing=pairing,
            encoder_threads=2,
        )

        def push() -> None:
            for layer, first_block, k, v in chunks:
                sender.send_blocks(layer, first_block, torch.stack((k, v)).unsqueeze(0), None)
            sender.finish(FirstToken(prefilled.first_token_id, None, None, 0.0, 0.0))

        return (await sender.run(push, lambda: None)).kv_bytes
    finally:
        await peers.close()


def test_the_sender_announces_chunks_encoded_meanwhile_in_one_message(
    decode_server: DecodeServerThread, player: PrefillPlayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over shm, chunks whose encoding finished while an earlier one was being written go out
    as one TransferKvRequest.chunks (decode sees them in one `_land`), and decode's tokens are
    the single-process ones."""
    if decode_server.instance.segment is None:
        pytest.skip("this host gave decode no shared-memory pool")
    landed = spy_landings(monkeypatch)
    prompt = random_prompt(21, player.vocab_size, seed=42)
    num_layers = TINY.num_hidden_layers

    async def body(client: Client) -> None:
        call, block_ids = await client.admit(generate_request("sent-batched", prompt))
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        chunks = [(layer, 0, k, v) for layer, (k, v) in enumerate(prefilled.kv)]
        with SecondJobFirst() as encoder:
            kv_bytes = await send_over_shm(
                decode_server, player, "sent-batched", prompt, block_ids, prefilled, chunks, encoder
            )
        assert landed == [list(range(num_layers))]
        assert kv_bytes == sum(k.nbytes + v.nbytes for k, v in prefilled.kv)
        outcome = await client.collect(call, Outcome(block_ids=list(block_ids)))
        assert outcome.token_ids == player.reference(prompt, SHORT)

    run(decode_server, body)


def test_an_in_place_sender_ends_with_its_last_chunks_and_the_commit_in_one_message(
    decode_server: DecodeServerThread, player: PrefillPlayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunks still encoding when the first token comes go out with the commit
    (KvChunks.commit): decode reads the transfer's last message as chunks with the commit and
    no commit message after it; its tokens are the single-process ones."""
    if decode_server.instance.segment is None:
        pytest.skip("this host gave decode no shared-memory pool")
    kinds: list[str] = []  # what decode read after the header, message by message
    take = Reader.take

    def spy(self: Reader[Any]) -> Any:
        message = take(self)
        if isinstance(message, kv_pb2.TransferKvRequest):
            kind = message.WhichOneof("kind")
            has_commit = kind == "chunks" and message.chunks.HasField("commit")
            kinds.append(f"{kind} + commit" if has_commit else str(kind))
        elif message is not None:
            kinds.append("chunk")
        return message

    monkeypatch.setattr(Reader, "take", spy)
    prompt = random_prompt(21, player.vocab_size, seed=45)

    async def body(client: Client) -> None:
        call, block_ids = await client.admit(generate_request("commit-rides", prompt))
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        chunks = [(layer, 0, k, v) for layer, (k, v) in enumerate(prefilled.kv)]
        with ThreadPoolExecutor(2) as encoder:  # all handed over at once, then the token
            await send_over_shm(
                decode_server, player, "commit-rides", prompt, block_ids, prefilled, chunks, encoder
            )
        assert kinds[-1] == "chunks + commit", kinds
        assert "commit" not in kinds
        outcome = await client.collect(call, Outcome(block_ids=list(block_ids)))
        assert outcome.token_ids == player.reference(prompt, SHORT)

    run(decode_server, body)


class CountingEncoder(ThreadPoolExecutor):
    """Two encoder threads that count the jobs handed to them."""

    def __init__(self) -> None:
        super().__init__(2)
        self.num_jobs = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        self.num_jobs += 1
        return super().submit(fn, *args, **kwargs)


def test_a_backlog_of_in_place_chunks_is_split_among_the_encoder_threads(
    decode_server: DecodeServerThread, player: PrefillPlayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over shm, chunks handed over all at once (one per layer and block here) are encoded as
    one job per encoder thread, not one job per chunk; decode lands every chunk, in order, and
    its tokens are the single-process ones."""
    if decode_server.instance.segment is None:
        pytest.skip("this host gave decode no shared-memory pool")
    landed = spy_landings(monkeypatch)
    prompt = random_prompt(37, player.vocab_size, seed=43)

    async def body(client: Client) -> None:
        call, block_ids = await client.admit(generate_request("split", prompt))
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        chunks = [
            (layer, j, k[j : j + 1], v[j : j + 1])
            for layer, (k, v) in enumerate(prefilled.kv)
            for j in range(k.shape[0])
        ]
        assert len(chunks) > 2 * 2  # more than one chunk per thread, and more than a batch
        with CountingEncoder() as encoder:
            await send_over_shm(
                decode_server, player, "split", prompt, block_ids, prefilled, chunks, encoder
            )
        assert encoder.num_jobs == 2
        assert [seq for seqs in landed for seq in seqs] == list(range(len(chunks)))
        outcome = await client.collect(call, Outcome(block_ids=list(block_ids)))
        assert outcome.token_ids == player.reference(prompt, SHORT)

    run(decode_server, body)


def test_a_grpc_pair_whose_chunks_decode_cannot_receive_is_refused(
    tiny_model_dir: Path, player: PrefillPlayer
) -> None:
    """Decode's Pair says the largest message it receives; a prefill whose KV chunks over grpc
    can be larger refuses the pair (FAILED_PRECONDITION naming both limits and the flags) where
    its every transfer would be refused by grpc's limit as RESOURCE_EXHAUSTED, which a client
    retries for good. In place (shm) the chunks carry no KV: the same limit is fine."""
    limit = 1 << 20
    server = DecodeServerThread(
        tiny_decode_config(tiny_model_dir, "off"),
        server_config=ServerConfig(max_message_bytes=limit, drain_timeout_s=2.0, grace_s=0.5),
    )
    endpoint = server.instance.endpoint

    async def pair(transports: tuple[str, ...]) -> tuple[str, dict[str, str]]:
        peers = Peers(
            64 << 20,
            largest_message_bytes=limit + 1,
            endpoint=endpoint._replace(transports=transports),
            layout=player.layout(),
            dtype=server.instance.cache.dtype,
        )
        try:
            return (await peers.pair(server.address)).transport, peers.transports()
        finally:
            await peers.close()

    try:
        with pytest.raises(FailedPrecondition) as refused:
            server.run(pair((kv_transport.GRPC,)))
        for words in (f"at most {limit} bytes", f"up to {limit + 1}", "--max-message-bytes"):
            assert words in str(refused.value)
        # Not remembered: the next transfer asks again, and in place the limit does not matter.
        assert server.run(pair(endpoint.transports)) == (
            kv_transport.SHM,
            {server.address: kv_transport.SHM},
        )
    finally:
        server.close()


def test_a_forced_transport_decode_cannot_use_warns_and_pairs_over_grpc(
    decode_server: DecodeServerThread, player: PrefillPlayer, caplog: pytest.LogCaptureFixture
) -> None:
    """--kv-transport shm with a decode on another host (its host id differs): the pair runs
    over grpc, as the module's table says, with a warning naming why, where an INFO line
    with "transport grpc" was all an operator who forced shm saw."""
    endpoint = decode_server.instance.endpoint

    async def pair(host_id: str) -> str:
        peers = Peers(
            64 << 20,
            endpoint=endpoint._replace(host_id=host_id, transports=(kv_transport.SHM,)),
            layout=player.layout(),
            dtype=decode_server.instance.cache.dtype,
        )
        try:
            return (await peers.pair(decode_server.address)).transport
        finally:
            await peers.close()

    with caplog.at_level(logging.WARNING, logger="mili.prefill"):
        assert decode_server.run(pair("another host")) == kv_transport.GRPC
        assert decode_server.run(pair(endpoint.host_id)) == kv_transport.SHM  # no warning
    warnings = [r.getMessage() for r in caplog.records if r.name == "mili.prefill"]
    assert warnings == [
        f"KV pair with decode at {decode_server.address}: --kv-transport shm cannot be used "
        "(decode's host id differs from ours: shared memory needs one host (--host-id)); grpc"
    ]


class GatedFirstJob(ThreadPoolExecutor):
    """Encoder threads whose first job waits until `gate` is set (`started` says it is in)."""

    def __init__(self) -> None:
        super().__init__(2)
        self.started = threading.Event()
        self.gate = threading.Event()
        self._num_jobs = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        self._num_jobs += 1
        if self._num_jobs > 1:
            return super().submit(fn, *args, **kwargs)

        def first() -> Any:
            self.started.set()
            assert self.gate.wait(10)
            return fn(*args, **kwargs)

        return super().submit(first)


def test_a_cancelled_in_place_sender_aborts_only_once_its_copies_are_over(
    decode_server: DecodeServerThread, player: PrefillPlayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The abort lets decode free the blocks at once (the test above), so the sender sends it
    only once no encode job of its own may still be copying into them."""
    if decode_server.instance.segment is None:
        pytest.skip("this host gave decode no shared-memory pool")
    monkeypatch.setattr(transfer_module, "_IN_PLACE_GRACE_S", 60.0)
    monkeypatch.setattr(sender_module, "_ABORT_ANSWER_S", 30.0)  # waits as long as it takes
    prompt = random_prompt(21, player.vocab_size, seed=43)
    senders: list[weakref.ref[KvSender]] = []
    init = KvSender.__init__

    def remembered(self: KvSender, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        senders.append(weakref.ref(self))

    monkeypatch.setattr(KvSender, "__init__", remembered)

    async def body(client: Client) -> None:
        call, block_ids = await client.admit(generate_request("cancelled-shm", prompt))
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        chunks = [(layer, 0, k, v) for layer, (k, v) in enumerate(prefilled.kv)]
        with GatedFirstJob() as encoder:
            sending = asyncio.ensure_future(
                send_over_shm(
                    decode_server,
                    player,
                    "cancelled-shm",
                    prompt,
                    block_ids,
                    prefilled,
                    chunks,
                    encoder,
                )
            )
            assert await asyncio.to_thread(encoder.started.wait, 10)
            sending.cancel()  # prefill's caller went away, a copy job under way
            read = asyncio.ensure_future(call.read())
            done, _ = await asyncio.wait({read}, timeout=0.5)
            assert not done, "the abort went out with a copy still under way"
            encoder.gate.set()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(read, 5)
            assert err.value.code() == Code.CANCELLED, err.value.details()
            with pytest.raises(asyncio.CancelledError):
                await sending
        await blocks_back(client, NUM_BLOCKS, timeout_s=5.0)
        # Found by a leak review: the job's Cancelled error held its frame, the frame the
        # sender, the sender the job: only a full collection freed it, with its pairing (a
        # dead decode's shm pool stayed mapped). Refcounting alone frees it now.
        del sending
        gc.disable()
        try:
            await asyncio.sleep(0.1)
            assert [ref() for ref in senders] == [None]
        finally:
            gc.enable()

    run(decode_server, body)
