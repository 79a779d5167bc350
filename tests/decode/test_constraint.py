"""Decode under a constraint, over real gRPC: its matcher starts from prefill's first token, the
tokens equal the single-process reference's exactly, a first token the grammar refuses fails
that request clearly, and a bad constraint is refused before any block is reserved."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from mili.engine.constraint.compiler import ConstraintCompiler
from mili.engine.constraint.spec import Constraint
from mili.engine.engine_config import EngineConfig
from mili.engine.generate import generate
from mili.engine.model.loader import load_model, tokenizer_vocab_size
from mili.engine.sampling_params import SamplingParams
from mili.pb.common.v1 import sampling_pb2
from mili.pb.decode.v1 import decode_pb2
from mili.rpc.client import insecure_channel
from mili.rpc.status import bad_request_of
from services.decode.config import DecodeConfig
from tests.decode.conftest import BLOCK_SIZE, NUM_BLOCKS
from tests.decode.harness import Client, DecodeServerThread, Outcome, PrefillPlayer, sampling
from tests.decode.harness import blocks_back as wait_blocks_back
from tests.engine.constraint_helpers import demo_grammar_tokenizer

REGEX = Constraint.regex(r"[a-z]{2,6}-[0-9]{1,3}")
PROMPT = [5, 77, 300, 12, 9, 41]


# Sync and overlapped steps (overlapped, a constrained row's mask is filled once the last
# step's token is appended, while the next forward runs).
@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "overlap"])
def server(demo_model_dir: Path, request: pytest.FixtureRequest) -> Iterator[DecodeServerThread]:
    config = DecodeConfig(
        model_dir=demo_model_dir,
        engine=EngineConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype="float32"),
        max_running=4,
        overlap_steps=request.param,
    )
    server = DecodeServerThread(config)
    yield server
    server.close()


@pytest.fixture(scope="module")
def player(demo_model_dir: Path) -> PrefillPlayer:
    player = PrefillPlayer(demo_model_dir, BLOCK_SIZE)
    player.model = load_model(demo_model_dir, dtype=torch.float32)  # the server's dtype
    return player


@pytest.fixture(scope="module")
def compiler(demo_model_dir: Path) -> ConstraintCompiler:
    return ConstraintCompiler(demo_grammar_tokenizer(demo_model_dir))


async def run(
    client: Client, player: PrefillPlayer, rid: str, params: SamplingParams, first: int
) -> Outcome:
    """Admit, play prefill with `first` as its sampled token, collect."""
    request = decode_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=PROMPT, sampling=sampling(params)
    )
    admitted = await client.admit(request)
    prefilled = await asyncio.to_thread(player.prefill, PROMPT, params)
    prefilled = dataclasses.replace(prefilled, first_token_id=first)
    return await client.transfer_and_collect(player, rid, PROMPT, admitted, prefilled)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tokens_equal_the_constrained_reference(
    server: DecodeServerThread,
    player: PrefillPlayer,
    compiler: ConstraintCompiler,
    demo_model_dir: Path,
    temperature: float,
) -> None:
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=30, constraint=REGEX)
    vocab = tokenizer_vocab_size(demo_model_dir)
    model = player.model
    expected = generate(model, [PROMPT], params, vocab_size=vocab, compiler=compiler)[0]
    assert expected.finish_reason == "stop"

    async def body() -> None:
        async with insecure_channel(server.address) as channel:
            client = Client(channel)
            out = await run(client, player, f"re-{temperature}", params, expected.token_ids[0])
            assert out.token_ids == expected.token_ids
            assert out.finish_reason == sampling_pb2.FINISH_REASON_STOP
            await wait_blocks_back(client, NUM_BLOCKS)

    server.run(body())


def test_a_first_token_the_grammar_refuses_fails_that_request(
    server: DecodeServerThread, player: PrefillPlayer, compiler: ConstraintCompiler
) -> None:
    params = SamplingParams(temperature=0, max_tokens=10, constraint=REGEX)
    refused = compiler.tokenizer.encode("7")[0]  # the regex starts with a letter

    async def body() -> None:
        async with insecure_channel(server.address) as channel:
            client = Client(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await run(client, player, "refused-first", params, refused)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "prefill's first token" in (info.value.details() or "")
            assert "sampling.regex" in (info.value.details() or "")
            await wait_blocks_back(client, NUM_BLOCKS)

    server.run(body())


def test_bad_constraint_is_refused_before_any_block(server: DecodeServerThread) -> None:
    params = SamplingParams(constraint=Constraint.json_schema({"type": "string", "not": {}}))

    async def body() -> None:
        async with insecure_channel(server.address) as channel:
            client = Client(channel)
            await client.info()
            request = decode_pb2.GenerateRequest(
                request_id="bad", prompt_token_ids=PROMPT, sampling=sampling(params)
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate(request, timeout=10).read()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            bad = bad_request_of(info.value)
            assert bad is not None
            assert [v.field for v in bad.field_violations] == ["sampling.json_schema"]
            assert (await client.info()).num_free_blocks == NUM_BLOCKS

    server.run(body())
