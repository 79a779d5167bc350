"""Decode's control RPCs guarded like TransferKv, and its requests bounded per method: an
admission (Generate, GenerateStream) from a caller outside --frontend and a Pair from one
outside --prefill are PERMISSION_DENIED before any block is reserved; an admission larger than
a prompt of the whole context is RESOURCE_EXHAUSTED from its size, and one of more ids than the
context INVALID_ARGUMENT before they are converted."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from mili.discovery import Callers, PeerSet, parse_targets
from mili.engine.engine_config import EngineConfig
from mili.engine.sampling_params import SamplingParams
from mili.pb.decode.v1 import decode_pb2
from mili.pb.kv.v1 import kv_pb2
from mili.rpc.client import insecure_channel
from mili.rpc.status import server_status_of
from services.decode.config import DecodeConfig
from tests.decode.conftest import BLOCK_SIZE, NUM_BLOCKS, TINY
from tests.decode.harness import Client, DecodeServerThread, PrefillPlayer, random_prompt, sampling

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _elsewhere(flag: str) -> Callers:
    """Callers on a host our test client (127.0.0.1) is not."""
    return Callers(flag, PeerSet(parse_targets(["127.0.0.9:50051"])))


@pytest.fixture(scope="module")
def guarded(tiny_model_dir: Path) -> Iterator[DecodeServerThread]:
    config = DecodeConfig(
        model_dir=tiny_model_dir, engine=EngineConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    )
    server = DecodeServerThread(
        config, frontends=_elsewhere("--frontend"), prefills=_elsewhere("--prefill")
    )
    try:
        yield server
    finally:
        server.close()


def _request(prompt: list[int]) -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(
        request_id="guarded", prompt_token_ids=prompt, sampling=sampling(GREEDY)
    )


def test_admission_and_pair_from_outside_the_allowed_callers_change_nothing(
    guarded: DecodeServerThread, player: PrefillPlayer
) -> None:
    async def body() -> None:
        async with insecure_channel(guarded.address) as channel:
            client = Client(channel)
            before = await client.info()  # Info stays open: a read of the load
            request = _request(random_prompt(20, player.vocab_size, seed=1))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.generate(request, timeout=5).read()
            assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "takes calls only from --frontend 127.0.0.9:50051" in (
                caught.value.details() or ""
            )

            async def starts() -> AsyncIterator[decode_pb2.GenerateStreamRequest]:
                start = decode_pb2.StreamedGenerate(request=request)
                yield decode_pb2.GenerateStreamRequest(starts=[start])

            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in client.decode.GenerateStream(starts(), timeout=5):
                    pass
            # A write racing the refusal can make grpc report INTERNAL ("Internal error from
            # Core") over it (CI saw it once); decode's status also rides the initial metadata.
            assert server_status_of(caught.value).code is grpc.StatusCode.PERMISSION_DENIED

            pair = kv_pb2.PairRequest(host_id="h", device="cpu", transports=["grpc"])
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.kv.Pair(pair, timeout=5)
            assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "--prefill 127.0.0.9:50051" in (caught.value.details() or "")

            after = await client.info()
            assert (after.num_free_blocks, after.num_waiting, after.num_running) == (
                before.num_free_blocks,
                0,
                0,
            )

    guarded.run(body())


def test_an_admission_over_its_size_or_the_context_is_refused_before_conversion(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    async def body() -> None:
        async with insecure_channel(decode_server.address) as channel:
            client = Client(channel)
            before = await client.info()
            # 1.6 MB: over Generate's limit (a prompt of the whole context) and over
            # GenerateStream's (a frontend's starts of 1 MiB at most, or one start alone).
            huge = _request([200] * 800_000)
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.generate(huge, timeout=10).read()
            assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "/mili.decode.v1.DecodeService/Generate is " in (caught.value.details() or "")

            async def starts() -> AsyncIterator[decode_pb2.GenerateStreamRequest]:
                yield decode_pb2.GenerateStreamRequest(
                    starts=[decode_pb2.StreamedGenerate(request=huge)]
                )

            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in client.decode.GenerateStream(starts(), timeout=10):
                    pass
            assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            # Within the size limit, but more ids than the context: counted, never converted.
            long = _request([7] * (TINY.max_position_embeddings + 1))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.generate(long, timeout=10).read()
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details() == (
                "prompt_token_ids: longer than the model's context of 256 tokens (got 257 ids)"
            )
            assert time.monotonic() - started < 5
            after = await client.info()
            assert after.num_free_blocks == before.num_free_blocks

    decode_server.run(body())


def test_the_lease_flag_fits_the_uint32_admitted_carries_it_in() -> None:
    """Found by a review: --kv-lease-ms of 2^32 or more started, then overflowed every
    Admitted message (each admission failed)."""
    for lease_ms in (0, 2**32):
        with pytest.raises(ValueError, match=r"--kv-lease-ms must be in \(0, 2\^32\)"):
            DecodeConfig(model_dir=Path("unused"), kv_lease_ms=lease_ms)
    assert DecodeConfig(model_dir=Path("unused"), kv_lease_ms=2**32 - 1).kv_lease_ms == 2**32 - 1


@pytest.mark.parametrize("max_running", [0, 2**16 + 1, 2**40])
def test_max_running_is_bounded(max_running: int) -> None:
    """Found by a flag review: --max-running 2**40 hung start-up (the graph batch sizes are
    listed up to it) and could not fit Info's uint32."""
    with pytest.raises(ValueError, match=r"--max-running must be in \[1, 65536\]"):
        DecodeConfig(model_dir=Path("unused"), max_running=max_running)
