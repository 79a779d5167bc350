"""Prefill in-process, the real decode service as a process: decode reserves, prefill streams the
KV into its blocks, decode's tokens equal single-process generation and both pools end full."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from mili.common.v1 import sampling_pb2
from mili.decode.v1 import decode_pb2, decode_pb2_grpc
from mili.engine.generate import generate
from mili.engine.sampling_params import SamplingParams
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
    assert process.terminate() == 0, process.stderr


@pytest.mark.parametrize("num_tokens", [7, 150])  # one block; chunked by prefill (64 a forward)
def test_decode_continues_from_prefill_kv(
    tiny: TinyModel, decode: ServiceProcess, num_tokens: int
) -> None:
    prompt = random_ids(num_tokens, tiny.model.config.vocab_size, seed=300 + num_tokens)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    expected = generate(tiny.model, [prompt], greedy)[0].token_ids
    request_id = f"with-decode-{num_tokens}"

    async def main() -> list[int]:
        async with (
            prefill_service(tiny) as prefill,
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
            return tokens

    try:
        tokens = asyncio.run(main())
    except grpc.aio.AioRpcError as err:  # pragma: no cover - shows decode's log on failure
        raise AssertionError(f"{err.code().name}: {err.details()}\n{decode.stderr}") from err
    assert tokens == expected
