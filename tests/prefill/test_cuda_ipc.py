"""cuda-ipc on a GPU host (-m gpu; skipped without CUDA): prefill in-process on the GPU, the real
decode service on the same GPU as a process. The pair takes cuda-ipc (or grpc when decode is
started with --kv-transport grpc: pinned host copies on both sides), decode's tokens equal
single-process generation, both pools end full; a decode killed mid-transfer fails the Prefill
call UNAVAILABLE and prefill drops its mapping (the pair is forgotten)."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time

import grpc
import pytest
import torch

from mili.engine.generate import generate
from mili.engine.model.loader import load_model
from mili.engine.sampling_params import SamplingParams
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

pytestmark = pytest.mark.gpu
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def gpu_tiny(tiny: TinyModel) -> TinyModel:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return dataclasses.replace(tiny, model=load_model(tiny.path, device="cuda"))


def start_decode(tiny: TinyModel, transport: str = "auto") -> ServiceProcess:
    return ServiceProcess(
        "serve-decode", "--model", str(tiny.path), "--port", "0", "--device", "cuda",
        "--dtype", "float32", "--attention", "torch", "--kv-transport", transport,
        "--block-size", str(BLOCK_SIZE), "--num-blocks", "64",
    )  # fmt: skip


async def admit(
    stub: decode_pb2_grpc.DecodeServiceStub, request_id: str, prompt: list[int], layout: object
) -> tuple[decode_pb2.Admitted, object]:
    stream = stub.Generate(
        decode_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=sampling_pb2.SamplingParams(
                temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True
            ),
            prefill_layout=layout,
        ),
        timeout=60,
    )
    events = aiter(stream)
    return (await anext(events)).admitted, events


@pytest.mark.parametrize(
    ("transport", "offered"), [("cuda-ipc", ["cuda-ipc", "grpc"]), ("grpc", ["grpc"])]
)
@pytest.mark.parametrize("num_tokens", [7, 150])
def test_gpu_greedy_equals_generate(
    gpu_tiny: TinyModel, num_tokens: int, transport: str, offered: list[str]
) -> None:
    prompt = random_ids(num_tokens, gpu_tiny.model.config.vocab_size, seed=70 + num_tokens)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    expected = generate(gpu_tiny.model, [prompt], greedy)[0].token_ids
    decode = start_decode(gpu_tiny, "auto" if transport == "cuda-ipc" else transport)
    try:

        async def main() -> list[int]:
            async with (
                prefill_service(gpu_tiny) as prefill,
                insecure_channel(decode.address) as channel,
            ):
                stub = decode_pb2_grpc.DecodeServiceStub(channel)
                before = await stub.Info(decode_pb2.InfoRequest())
                assert list(before.kv_transports) == offered
                admitted, events = await admit(stub, "ipc", prompt, prefill.servicer.layout)
                await prefill.stub.Prefill(
                    prefill_request(
                        "ipc", prompt, decode.address,
                        list(admitted.prompt_block_ids), admitted.transfer_token,
                    ),
                    timeout=30,
                )  # fmt: skip
                tokens: list[int] = []
                async for event in events:  # type: ignore[attr-defined]
                    tokens.extend(event.tokens.token_ids)
                info = await prefill.stub.Info(prefill_pb2.InfoRequest())
                assert dict(info.kv_transports) == {decode.address: transport}
                after = await stub.Info(decode_pb2.InfoRequest())
                assert after.num_free_blocks == before.num_free_blocks
                return tokens

        assert asyncio.run(main()) == expected
    finally:
        assert decode.terminate() == 0, decode.stderr


def test_cuda_ipc_decode_killed_mid_transfer_is_unavailable(gpu_tiny: TinyModel) -> None:
    prompt = random_ids(150, gpu_tiny.model.config.vocab_size, seed=9)
    decode = start_decode(gpu_tiny)
    try:

        async def main() -> grpc.aio.AioRpcError:
            async with (
                prefill_service(gpu_tiny) as prefill,
                insecure_channel(decode.address) as channel,
            ):
                stub = decode_pb2_grpc.DecodeServiceStub(channel)
                assert (await prefill.servicer.peers.pair(decode.address)).transport == "cuda-ipc"
                admitted, _ = await admit(stub, "victim", prompt, prefill.servicer.layout)
                decode.proc.send_signal(signal.SIGSTOP)
                call = prefill.stub.Prefill(
                    prefill_request(
                        "victim", prompt, decode.address,
                        list(admitted.prompt_block_ids), admitted.transfer_token,
                    ),
                    timeout=30,
                )  # fmt: skip
                await asyncio.sleep(0.5)
                killed_at = time.monotonic()
                decode.proc.kill()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert time.monotonic() - killed_at < 5
                assert prefill.servicer.peers.transports() == {}  # mapping dropped
                return err.value

        err = asyncio.run(main())
        assert err.code() is grpc.StatusCode.UNAVAILABLE, err.details()
    finally:
        decode.proc.kill()
        decode.proc.wait()
