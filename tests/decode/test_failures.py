"""Every way a request can fail ends with a clear status and gives back every block."""

from __future__ import annotations

import asyncio
import shutil
import struct
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from mili.engine.sampling_params import SamplingParams
from mili.pb.common.v1 import sampling_pb2
from mili.pb.decode.v1 import decode_pb2
from mili.pb.kv.v1 import kv_pb2
from mili.rpc.client import insecure_channel
from mili.rpc.status import bad_request_of, retry_info_of, unavailable_peer_of
from tests.decode.conftest import BLOCK_SIZE, NUM_BLOCKS
from tests.decode.harness import (
    Client,
    DecodeServerThread,
    Outcome,
    PrefillPlayer,
    blocks_back,
    random_prompt,
    sampling,
)

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
Code = grpc.StatusCode


def generate_request(
    request_id: str, prompt: list[int], params: SamplingParams, **fields: Any
) -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling(params), **fields
    )


async def expect_error(awaitable: Awaitable[Any], code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable
    assert info.value.code() == code, info.value.details()
    return info.value


async def refused_at_header(
    client: Client, header: kv_pb2.TransferKvRequest, code: grpc.StatusCode
) -> grpc.aio.AioRpcError:
    """Send a transfer's header alone and await the verdict without writing more: when the
    server ends a call while the client is still writing, grpc's client may report INTERNAL
    ("execute_batch" failed) in place of the server's status."""
    call = client.kv.TransferKv(timeout=10)
    await call.write(header)
    return await expect_error(call, code)


def run(server: DecodeServerThread, body: Callable[[Client], Awaitable[None]]) -> None:
    async def main() -> None:
        async with insecure_channel(server.address) as channel:
            client = Client(channel)
            assert (await client.info()).num_free_blocks == NUM_BLOCKS
            await body(client)
            await blocks_back(client, NUM_BLOCKS)

    server.run(main())


# ---- cancellation, deadlines, leases ---------------------------------------------------------


def test_cancel_mid_stream_frees_blocks_within_a_step(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    prompt = random_prompt(10, player.vocab_size, seed=1)
    batcher = decode_server.instance.batcher

    async def body(client: Client) -> None:
        call, block_ids = await client.admit(generate_request("cancel", prompt, LONG))
        prefilled = await asyncio.to_thread(player.prefill, prompt, LONG)
        await client.kv.TransferKv(iter(player.messages("cancel", prompt, block_ids, prefilled)))
        first = await call.read()
        assert list(first.tokens.token_ids)
        steps_before = batcher.num_steps
        call.cancel()
        await blocks_back(client, NUM_BLOCKS, timeout_s=2.0)
        # Dropped early, not run to the end of its 200 tokens.
        assert batcher.num_steps - steps_before < 150

    run(decode_server, body)


def test_generate_deadline_while_waiting_for_kv_frees_blocks(
    decode_server: DecodeServerThread,
) -> None:
    async def body(client: Client) -> None:
        call = client.generate(generate_request("deadline", [5, 6, 7], LONG), timeout=0.3)
        assert (await call.read()).WhichOneof("event") == "admitted"
        await expect_error(call.read(), Code.DEADLINE_EXCEEDED)

    run(decode_server, body)


def test_lease_expiry_fails_request_and_frees_blocks(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    prompt = random_prompt(12, player.vocab_size, seed=2)

    async def body(client: Client) -> None:
        request = generate_request("lease", prompt, LONG, kv_lease_ms=150)
        call, block_ids = await client.admit(request)
        err = await expect_error(call.read(), Code.DEADLINE_EXCEEDED)
        assert "lease of 150 ms" in err.details()
        await blocks_back(client, NUM_BLOCKS)
        # A transfer arriving after the lease finds no reservation.
        prefilled = await asyncio.to_thread(player.prefill, prompt, LONG)
        messages = player.messages("lease", prompt, block_ids, prefilled)
        await refused_at_header(client, messages[0], Code.NOT_FOUND)

    run(decode_server, body)


def test_lease_expiry_mid_transfer_stops_the_transfer(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    prompt = random_prompt(12, player.vocab_size, seed=3)

    async def body(client: Client) -> None:
        request = generate_request("lease2", prompt, LONG, kv_lease_ms=300)
        call, block_ids = await client.admit(request)
        prefilled = await asyncio.to_thread(player.prefill, prompt, LONG)
        messages = player.messages("lease2", prompt, block_ids, prefilled)
        transfer = client.kv.TransferKv(timeout=10)
        await transfer.write(messages[0])  # header
        await transfer.write(messages[1])  # layer 0
        # The sender goes quiet; the lease ends both calls without waiting for its next chunk.
        await expect_error(call.read(), Code.DEADLINE_EXCEEDED)
        err = await expect_error(transfer, Code.DEADLINE_EXCEEDED)
        assert "lease" in err.details()

    run(decode_server, body)


# ---- broken transfers --------------------------------------------------------------------------


def _sign(chunk: kv_pb2.KvChunk) -> None:
    """The checksum a sender computes: CRC-32 of the chunk's place (seq, layer, block ids as
    little-endian uint64s), then its data."""
    place = struct.pack(f"<{2 + len(chunk.block_ids)}Q", chunk.seq, chunk.layer, *chunk.block_ids)
    chunk.crc32 = zlib.crc32(place + chunk.data)


def _flip_byte(chunk: kv_pb2.KvChunk) -> None:
    data = bytearray(chunk.data)
    data[len(data) // 2] ^= 0x40
    chunk.data = bytes(data)  # crc32 left as it was: corrupt in transit


def _truncate(chunk: kv_pb2.KvChunk) -> None:
    chunk.data = chunk.data[:-8]
    _sign(chunk)  # consistent checksum, wrong length


def _block_twice(chunk: kv_pb2.KvChunk) -> None:
    """Name the chunk's first block again in place of its last (same length, same data)."""
    chunk.block_ids[-1] = chunk.block_ids[0]


def _drop_last_block(chunk: kv_pb2.KvChunk) -> None:
    """Leave the chunk's last block out, data and checksum kept consistent: that block of the
    layer is never sent."""
    del chunk.block_ids[-1]
    chunk.data = (
        chunk.data[: len(chunk.data) // 2 - _half_block(chunk)]
        + chunk.data[len(chunk.data) // 2 : -_half_block(chunk)]
    )
    _sign(chunk)


def _half_block(chunk: kv_pb2.KvChunk) -> int:
    """Bytes of one block of K (or V) in a chunk that had one block more than it names."""
    return len(chunk.data) // 2 // (len(chunk.block_ids) + 1)


def _foreign_block(chunk: kv_pb2.KvChunk) -> None:
    """Point the chunk's last block at one the request does not hold (someone else's)."""
    chunk.block_ids[-1] = next(b for b in range(NUM_BLOCKS) if b not in chunk.block_ids)


Mangle = Callable[[list[kv_pb2.TransferKvRequest]], list[kv_pb2.TransferKvRequest]]


def _mangle_chunk(index: int, edit: Callable[[kv_pb2.KvChunk], None]) -> Mangle:
    def mangle(messages: list[kv_pb2.TransferKvRequest]) -> list[kv_pb2.TransferKvRequest]:
        edit(messages[index].chunk)
        return messages

    return mangle


def _set_chunk(index: int, **fields: Any) -> Mangle:
    def edit(chunk: kv_pb2.KvChunk) -> None:
        for name, value in fields.items():
            if name == "block_ids":
                del chunk.block_ids[:]
                chunk.block_ids.extend(value)
            else:
                setattr(chunk, name, value)

    return _mangle_chunk(index, edit)


def _swap_layers(messages: list[kv_pb2.TransferKvRequest]) -> list[kv_pb2.TransferKvRequest]:
    """Chunks 0 and 1 labelled with each other's layer (a sender's bookkeeping bug)."""
    first, second = messages[1].chunk, messages[2].chunk
    first.layer, second.layer = second.layer, first.layer
    return messages


def _reverse_blocks(chunk: kv_pb2.KvChunk) -> None:
    chunk.block_ids.reverse()


# messages: [header, chunk layer 0, chunk layer 1, commit]
CORRUPTIONS: dict[str, tuple[Mangle, str]] = {
    "bad-crc": (_mangle_chunk(1, _flip_byte), "checksum mismatch"),
    "short-data": (_mangle_chunk(2, _truncate), "bytes for"),
    "duplicate": (lambda m: [m[0], m[1], m[1], m[2], m[3]], "expected chunk 1"),
    "reordered": (lambda m: [m[0], m[2], m[1], m[3]], "expected chunk 0"),
    "missing-chunk": (lambda m: [m[0], m[1], m[3]], "commit after 1 chunk,"),
    "no-commit": (lambda m: m[:3], "without a commit"),
    "wrong-request-id": (_set_chunk(1, request_id="someone-else"), "carries request id"),
    "foreign-block": (_mangle_chunk(2, _foreign_block), "not among"),
    "same-layer-twice": (_set_chunk(2, layer=0), "sent more than once"),
    "block-twice-in-chunk": (_mangle_chunk(1, _block_twice), "sent more than once"),
    "block-never-sent": (_mangle_chunk(2, _drop_last_block), "pairs never sent, e.g. layer 1"),
    "layer-out-of-range": (_set_chunk(2, layer=99), "layer out of range"),
    # each place still comes once: only the checksum, which binds the place, tells
    "layers-swapped": (_swap_layers, "checksum mismatch"),
    "blocks-reordered": (_mangle_chunk(1, _reverse_blocks), "checksum mismatch"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_transfer_is_data_loss_on_both_calls_and_frees_blocks(
    decode_server: DecodeServerThread, player: PrefillPlayer, corruption: str
) -> None:
    mangle, message = CORRUPTIONS[corruption]
    prompt = random_prompt(13, player.vocab_size, seed=4)  # 2 prompt blocks
    request_id = f"corrupt-{corruption}"

    async def body(client: Client) -> None:
        call, block_ids = await client.admit(generate_request(request_id, prompt, SHORT))
        assert len(block_ids) == 2
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        messages = mangle(player.messages(request_id, prompt, block_ids, prefilled))
        err = await expect_error(client.kv.TransferKv(iter(messages)), Code.DATA_LOSS)
        assert message in err.details()
        err = await expect_error(call.read(), Code.DATA_LOSS)
        assert message in err.details()

    run(decode_server, body)


@pytest.mark.parametrize("after", ["commit", "chunk"])
def test_a_message_after_the_commit_is_refused_and_the_blocks_freed(
    decode_server: DecodeServerThread, player: PrefillPlayer, after: str
) -> None:
    """Found by an exploratory test: a second commit or a chunk after the commit went unread
    and the transfer was answered OK."""
    prompt = random_prompt(13, player.vocab_size, seed=79)
    request_id = f"after-{after}"

    async def body(client: Client) -> None:
        call, block_ids = await client.admit(generate_request(request_id, prompt, SHORT))
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        messages = player.messages(request_id, prompt, block_ids, prefilled)
        assert messages[-1].WhichOneof("kind") == "commit"
        messages.append(messages[-1] if after == "commit" else messages[1])
        err = await expect_error(client.kv.TransferKv(iter(messages)), Code.INVALID_ARGUMENT)
        assert "last message" in (err.details() or "")
        await expect_error(call.read(), Code.DATA_LOSS)
        await blocks_back(client, NUM_BLOCKS)

    run(decode_server, body)


@pytest.mark.parametrize("fault", ["malformed-message", "header-token-count"])
def test_a_transfer_refused_as_malformed_is_data_loss_on_generate(
    decode_server: DecodeServerThread, player: PrefillPlayer, fault: str
) -> None:
    """TransferKv refuses its caller's (prefill's) mistake as INVALID_ARGUMENT; the request's
    Generate stream says DATA_LOSS, never INVALID_ARGUMENT naming a field of prefill's message
    (the frontend would answer its client 400) nor UNKNOWN (grpc's AbortError passed on)."""
    prompt = random_prompt(13, player.vocab_size, seed=78)
    request_id = f"refused-{fault}"

    async def body(client: Client) -> None:
        call, block_ids = await client.admit(generate_request(request_id, prompt, SHORT))
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        messages = player.messages(request_id, prompt, block_ids, prefilled)
        raw = client.channel.stream_unary(  # bytes as written, not a message
            "/mili.kv.v1.KvTransferService/TransferKv"
        )(timeout=10)
        if fault == "malformed-message":
            await raw.write(messages[0].SerializeToString())
            await raw.write(b"\xff\xff\xff")
        else:
            messages[0].header.num_tokens += 1
            await raw.write(messages[0].SerializeToString())
        await expect_error(raw, Code.INVALID_ARGUMENT)
        err = await expect_error(call.read(), Code.DATA_LOSS)
        assert "KV transfer from prefill" in (err.details() or "")

    run(decode_server, body)


def test_sender_dying_mid_transfer_fails_request_and_frees_blocks(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    prompt = random_prompt(20, player.vocab_size, seed=5)

    async def body(client: Client) -> None:
        call, block_ids = await client.admit(generate_request("sender-dies", prompt, LONG))
        prefilled = await asyncio.to_thread(player.prefill, prompt, LONG)
        messages = player.messages("sender-dies", prompt, block_ids, prefilled)
        transfer = client.kv.TransferKv(timeout=10)
        await transfer.write(messages[0])
        await transfer.write(messages[1])
        await client.info()  # a round trip, so the chunk has surely been read
        transfer.cancel()  # the stream breaks as if the prefill process died
        err = await expect_error(call.read(), Code.UNAVAILABLE)
        assert "broke off" in err.details()
        # The sender is to blame, not this instance: the frontend keeps routing to it.
        assert unavailable_peer_of(err) is not None

    run(decode_server, body)


# a sender's abort code -> the request's status, and whether that blames the sender
ABORTS = {
    "resource-exhausted": (Code.RESOURCE_EXHAUSTED, Code.RESOURCE_EXHAUSTED, False),
    "cancelled": (Code.CANCELLED, Code.CANCELLED, False),
    "prefill-stopping": (Code.UNAVAILABLE, Code.UNAVAILABLE, True),
    "compute-failed": (Code.INTERNAL, Code.UNAVAILABLE, True),
}


@pytest.mark.parametrize("case", list(ABORTS))
def test_a_sender_giving_up_on_purpose_fails_the_request_with_its_status(
    decode_server: DecodeServerThread, player: PrefillPlayer, case: str
) -> None:
    """Issue 29: a sender that cancels its transfer says so (an abort message), and the request
    fails with the sender's status, not as a sender that died."""
    sent, expected, blames_sender = ABORTS[case]
    prompt = random_prompt(20, player.vocab_size, seed=5)
    request_id = f"sender-aborts-{case}"

    async def body(client: Client) -> None:
        call, block_ids = await client.admit(generate_request(request_id, prompt, LONG))
        prefilled = await asyncio.to_thread(player.prefill, prompt, LONG)
        header, chunk = player.messages(request_id, prompt, block_ids, prefilled)[:2]
        abort = kv_pb2.TransferAbort(code=sent.value[0], message="prefill queue is full")
        messages = [header, chunk, kv_pb2.TransferKvRequest(abort=abort)]
        await expect_error(client.kv.TransferKv(iter(messages), timeout=10), expected)
        err = await expect_error(call.read(), expected)
        assert "gave up the KV transfer" in err.details()
        assert f"{sent.name}: prefill queue is full" in err.details()
        assert (unavailable_peer_of(err) is not None) is blames_sender

    run(decode_server, body)


def test_layout_mismatch_is_refused_naming_both(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    async def body(client: Client) -> None:
        for field, ours, theirs in [("block_size", 8, 16), ("dtype", "float32", "bfloat16")]:
            layout = player.layout(**{field: theirs})
            request = generate_request("layout", [5, 6], SHORT, prefill_layout=layout)
            call = client.generate(request, timeout=5)
            err = await expect_error(call.read(), Code.FAILED_PRECONDITION)
            assert f"{field}={ours}" in err.details() and f"{field}={theirs}" in err.details()
        # The same check on the transfer's header fails the request too.
        prompt = [5, 6, 7]
        call, block_ids = await client.admit(generate_request("layout2", prompt, SHORT))
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        layout = player.layout(num_kv_heads=4)
        messages = player.messages("layout2", prompt, block_ids, prefilled, layout=layout)
        err = await refused_at_header(client, messages[0], Code.FAILED_PRECONDITION)
        assert "num_kv_heads=2" in err.details() and "num_kv_heads=4" in err.details()
        await expect_error(call.read(), Code.FAILED_PRECONDITION)

    run(decode_server, body)


def test_a_transfer_refused_at_its_first_message_names_no_huge_id_and_trims_the_heap(
    decode_server: DecodeServerThread, player: PrefillPlayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by an exploratory test: a header with a 50 MB request_id was looked up (NOT_FOUND
    quoting it), and such refusals, or a 60 MB chunk before any header, left decode's resident
    memory larger each time (a stream's messages ask for no trim)."""
    from mili.rpc import heap

    trims: list[None] = []
    monkeypatch.setattr(heap, "release_soon", lambda: trims.append(None))

    async def body(client: Client) -> None:
        header = kv_pb2.TransferHeader(
            request_id="x" * (1 << 20), layout=player.layout(), num_tokens=1
        )
        refused = kv_pb2.TransferKvRequest(header=header)
        err = await refused_at_header(client, refused, Code.INVALID_ARGUMENT)
        details = err.details() or ""
        assert "header.request_id" in details and "1048576 characters" in details
        assert len(details) < 1000
        assert len(trims) == 1
        chunk = kv_pb2.TransferKvRequest(chunk=kv_pb2.KvChunk(data=bytes(1 << 20)))
        await refused_at_header(client, chunk, Code.DATA_LOSS)
        assert len(trims) == 2

    run(decode_server, body)


def test_transfer_for_unknown_or_busy_request_is_not_found(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    async def body(client: Client) -> None:
        header = kv_pb2.TransferHeader(request_id="nobody", layout=player.layout(), num_tokens=1)
        await refused_at_header(client, kv_pb2.TransferKvRequest(header=header), Code.NOT_FOUND)
        # A second transfer for a request already receiving one.
        call, reserved = await client.admit(generate_request("busy", [5, 6], SHORT))
        header = kv_pb2.TransferHeader(
            request_id="busy",
            layout=player.layout(),
            num_tokens=2,
            transfer_token=reserved.transfer_token,
        )
        first = client.kv.TransferKv(timeout=10)
        await first.write(kv_pb2.TransferKvRequest(header=header))
        await client.info()
        second = kv_pb2.TransferKvRequest(header=header)
        err = await refused_at_header(client, second, Code.NOT_FOUND)
        assert "transferring" in err.details()
        call.cancel()  # the caller goes away: the transfer into its blocks stops at once
        err = await expect_error(first, Code.CANCELLED)
        assert "cancelled by its caller" in err.details()

    run(decode_server, body)


def test_a_forged_header_is_refused_and_leaves_the_request_alone(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    """Whoever learns a request's id cannot fill or end its reservation: without the transfer
    token from Admitted the header is PERMISSION_DENIED, and the real transfer still lands."""
    prompt = random_prompt(9, player.vocab_size, seed=41)

    async def body(client: Client) -> None:
        call, reserved = await client.admit(generate_request("victim", prompt, SHORT))
        prefilled = await asyncio.to_thread(player.prefill, prompt, SHORT)
        genuine = player.messages("victim", prompt, reserved, prefilled)
        for token in ("", "0" * 32, reserved.transfer_token[:-1] + "x"):
            forged = [kv_pb2.TransferKvRequest() for _ in genuine]
            for mine, theirs in zip(forged, genuine, strict=True):
                mine.CopyFrom(theirs)
            forged[0].header.transfer_token = token
            err = await refused_at_header(client, forged[0], Code.PERMISSION_DENIED)
            assert "transfer token" in err.details()
        assert (await client.info()).num_waiting == 1  # still waiting for its KV
        reply = await client.kv.TransferKv(iter(genuine), timeout=30)
        assert reply.num_blocks == len(reserved)
        outcome = await client.collect(call, Outcome())
        assert outcome.token_ids == player.reference(prompt, SHORT)

    run(decode_server, body)


# ---- admission -----------------------------------------------------------------------------------


def test_pool_too_small_is_resource_exhausted_with_retry_info(
    decode_server: DecodeServerThread,
) -> None:
    big = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)  # 8 + 239 -> 31 blocks

    async def body(client: Client) -> None:
        calls = [
            (await client.admit(generate_request(f"big-{i}", [5] * 8, big)))[0] for i in range(4)
        ]
        assert (await client.info()).num_free_blocks == NUM_BLOCKS - 4 * 31
        assert (await client.info()).num_waiting == 4
        call = client.generate(generate_request("big-4", [5] * 8, big), timeout=5)
        err = await expect_error(call.read(), Code.RESOURCE_EXHAUSTED)
        assert "needs 31" in err.details()
        info = retry_info_of(err)
        assert info is not None and info.retry_delay.ToNanoseconds() > 0
        for call in calls:
            call.cancel()

    run(decode_server, body)


def test_admitted_request_bound_is_resource_exhausted(decode_server: DecodeServerThread) -> None:
    async def body(client: Client) -> None:
        max_running = decode_server.instance.config.max_running
        calls = [
            (await client.admit(generate_request(f"small-{i}", [5], SHORT)))[0]
            for i in range(max_running)
        ]
        call = client.generate(generate_request("one-too-many", [5], SHORT), timeout=5)
        err = await expect_error(call.read(), Code.RESOURCE_EXHAUSTED)
        assert f"limit {max_running}" in err.details() and retry_info_of(err) is not None
        for call in calls:
            call.cancel()

    run(decode_server, body)


INVALID: dict[str, tuple[decode_pb2.GenerateRequest, list[str]]] = {
    "empty-id": (generate_request("", [5], SHORT), ["request_id"]),
    "empty-prompt": (generate_request("r", [], SHORT), ["prompt_token_ids"]),
    "out-of-vocab": (generate_request("r", [5, 256], SHORT), ["prompt_token_ids"]),
    "bad-sampling": (
        decode_pb2.GenerateRequest(
            request_id="r",
            prompt_token_ids=[5],
            sampling=sampling_pb2.SamplingParams(top_p=0, temperature=-1, max_tokens=0),
        ),
        ["sampling.temperature", "sampling.top_p", "sampling.max_tokens"],
    ),
    "past-context": (
        generate_request("r", [5] * 10, SamplingParams(max_tokens=247)),
        ["sampling.max_tokens"],
    ),
    # sampling.proto's rules for ids, which decode once took on the frontend's word
    "stop-id-out-of-vocab": (
        generate_request("r", [5], SamplingParams(max_tokens=4, stop_token_ids=[7, 2**32 - 1])),
        ["sampling.stop_token_ids[1]"],
    ),
    "bias-id-out-of-vocab": (
        generate_request("r", [5], SamplingParams(max_tokens=4, logit_bias=((5000, 1.0),))),
        ["sampling.logit_bias"],
    ),
    "bias-too-many": (
        decode_pb2.GenerateRequest(
            request_id="r",
            prompt_token_ids=[5],
            sampling=sampling_pb2.SamplingParams(
                max_tokens=4, logit_bias={i: 1.0 for i in range(5000)}
            ),
        ),
        ["sampling.logit_bias"],
    ),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_requests_name_their_fields(decode_server: DecodeServerThread, case: str) -> None:
    request, fields = INVALID[case]

    async def body(client: Client) -> None:
        call = client.generate(request, timeout=5)
        err = await expect_error(call.read(), Code.INVALID_ARGUMENT)
        bad_request = bad_request_of(err)
        assert bad_request is not None
        assert [v.field for v in bad_request.field_violations] == fields

    run(decode_server, body)


def test_ids_past_the_tokenizers_vocabulary_are_refused_where_the_model_has_rows(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # A padded embedding table, as Qwen3's: the model has 256 rows, its tokenizer 200 ids.
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from mili.engine.engine_config import EngineConfig
    from services.decode.config import DecodeConfig

    model_dir = tmp_path / "padded"
    shutil.copytree(tiny_model_dir, model_dir)
    words = WordLevel({f"t{i}": i for i in range(200)}, unk_token="t0")
    Tokenizer(words).save(str(model_dir / "tokenizer.json"))
    config = DecodeConfig(
        model_dir=model_dir,
        engine=EngineConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
        max_running=2,
    )
    server = DecodeServerThread(config)
    try:
        assert (server.instance.vocab_size, server.instance.model.config.vocab_size) == (200, 256)

        async def body(client: Client) -> None:
            call = client.generate(generate_request("r", [5, 200], SHORT), timeout=5)
            err = await expect_error(call.read(), Code.INVALID_ARGUMENT)
            assert "[0, 200)" in err.details()
            bad_request = bad_request_of(err)
            assert bad_request is not None
            assert [v.field for v in bad_request.field_violations] == ["prompt_token_ids"]

        run(server, body)
    finally:
        server.close()


def test_duplicate_active_request_id_is_refused(decode_server: DecodeServerThread) -> None:
    async def body(client: Client) -> None:
        call, _ = await client.admit(generate_request("twin", [5], SHORT))
        twin = client.generate(generate_request("twin", [6], SHORT), timeout=5)
        err = await expect_error(twin.read(), Code.INVALID_ARGUMENT)
        assert "already exists" in err.details()
        call.cancel()

    run(decode_server, body)
