"""Decode over real gRPC equals the single-process engine: greedy tokens, batching, stop rules."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from mili.engine.engine_config import EngineConfig
from mili.engine.generate import generate
from mili.engine.sampling_params import SamplingParams
from mili.pb.common.v1 import sampling_pb2
from mili.rpc.client import insecure_channel
from mili.rpc.kv_layout import block_bytes
from services.decode.config import DecodeConfig
from tests.decode.conftest import BLOCK_SIZE, NUM_BLOCKS
from tests.decode.harness import (
    Client,
    DecodeServerThread,
    PrefillPlayer,
    blocks_back,
    random_prompt,
)

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
STOP = sampling_pb2.FINISH_REASON_STOP
LENGTH = sampling_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize(
    "prompt_len",
    [5, BLOCK_SIZE, 2 * BLOCK_SIZE + 5],
    ids=["shorter-than-a-block", "one-block", "several-blocks"],
)
def test_greedy_tokens_equal_single_process_generate(
    decode_server: DecodeServerThread, player: PrefillPlayer, prompt_len: int
) -> None:
    prompt = random_prompt(prompt_len, player.vocab_size, seed=prompt_len)
    expected = player.reference(prompt, GREEDY)

    async def body() -> None:
        async with insecure_channel(decode_server.address) as channel:
            client = Client(channel)
            assert (await client.info()).num_free_blocks == NUM_BLOCKS
            out = await client.run_request(player, f"greedy-{prompt_len}", prompt, GREEDY)
            assert len(out.block_ids) == -(-prompt_len // BLOCK_SIZE)
            assert out.token_ids == expected
            assert len(out.token_ids) == 40
            assert out.finish_reason == LENGTH
            await blocks_back(client, NUM_BLOCKS)

    decode_server.run(body())


def test_eight_concurrent_requests_batch_and_equal_reference(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    prompts = [random_prompt(3 + 4 * i, player.vocab_size, seed=100 + i) for i in range(8)]
    expected = [player.reference(p, GREEDY) for p in prompts]
    # All KV lands before any commit, then the eight commits go out together: they join the
    # batch within a step or two of each other, long before the first has 40 tokens.
    barrier = asyncio.Barrier(8)

    async def commit_together() -> None:
        await barrier.wait()

    async def body() -> None:
        async with insecure_channel(decode_server.address) as channel:
            client = Client(channel)
            outcomes = await asyncio.gather(
                *(
                    client.run_request(
                        player, f"batch-{i}", p, GREEDY, before_commit=commit_together
                    )
                    for i, p in enumerate(prompts)
                )
            )
            assert [o.token_ids for o in outcomes] == expected
            await blocks_back(client, NUM_BLOCKS)

    decode_server.run(body())
    assert decode_server.instance.batcher.max_batch_size == 8


def test_logprobs_per_token_match_reference(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompt = random_prompt(11, player.vocab_size, seed=7)
    ref = generate(player.model, [prompt], params, block_size=BLOCK_SIZE)[0]
    assert ref.logprobs is not None and ref.top_logprobs is not None

    async def body() -> None:
        async with insecure_channel(decode_server.address) as channel:
            out = await Client(channel).run_request(player, "logprobs", prompt, params)
            assert out.token_ids == ref.token_ids
            assert len(out.logprobs) == 12
            for i, lp in enumerate(out.logprobs):
                assert lp.chosen.token_id == out.token_ids[i]
                assert lp.chosen.logprob == pytest.approx(ref.logprobs[i], abs=1e-4)
                assert [t.token_id for t in lp.top] == [t for t, _ in ref.top_logprobs[i]]

    decode_server.run(body())


def prompt_stopping_at(player: PrefillPlayer, seed: int) -> tuple[list[int], list[int], int]:
    """A prompt, its greedy reference, and an index i >= 3 whose token occurs nowhere before i,
    so a stop/EOS set to reference[i] ends generation exactly there (random weights repeat
    tokens a lot: search a few prompts)."""
    for attempt in range(50):
        prompt = random_prompt(9, player.vocab_size, seed=seed + attempt)
        reference = player.reference(prompt, GREEDY)
        for i in range(3, len(reference) - 1):
            if reference[i] not in reference[:i]:
                return prompt, reference, i
    raise AssertionError("no prompt with a fresh token past index 3")


def test_stop_token_id_ends_with_that_token(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    prompt, reference, i = prompt_stopping_at(player, seed=21)
    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=(reference[i],)
    )

    async def body() -> None:
        async with insecure_channel(decode_server.address) as channel:
            client = Client(channel)
            out = await client.run_request(player, "stop-id", prompt, params)
            assert out.token_ids == reference[: i + 1]
            assert out.finish_reason == STOP
            await blocks_back(client, NUM_BLOCKS)

    decode_server.run(body())


def test_max_tokens_counts_prefills_first_token(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    prompt = random_prompt(6, player.vocab_size, seed=22)
    reference = player.reference(prompt, GREEDY)

    async def body() -> None:
        async with insecure_channel(decode_server.address) as channel:
            client = Client(channel)
            for max_tokens in (1, 2, 9):
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                out = await client.run_request(player, f"len-{max_tokens}", prompt, params)
                assert out.token_ids == reference[:max_tokens]
                assert out.finish_reason == LENGTH
            await blocks_back(client, NUM_BLOCKS)

    decode_server.run(body())


@pytest.fixture(scope="module")
def eos_setup(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[DecodeServerThread, list[int], list[int], int]]:
    """A decode server whose generation_config.json names a token the reference emits as EOS."""
    player = PrefillPlayer(tiny_model_dir, BLOCK_SIZE)
    prompt, reference, i = prompt_stopping_at(player, seed=300)
    model_dir = tmp_path_factory.mktemp("eos-model")
    for file in tiny_model_dir.iterdir():
        shutil.copy(file, model_dir / file.name)
    # config.json says eos 1; generation_config.json must win (as in Qwen3 chat checkpoints).
    (model_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [reference[i], 2]})
    )
    server = DecodeServerThread(
        DecodeConfig(model_dir=model_dir, engine=EngineConfig(block_size=BLOCK_SIZE, num_blocks=32))
    )
    yield server, prompt, reference, i
    server.close()


def test_eos_from_generation_config_stops_unless_ignore_eos(
    eos_setup: tuple[DecodeServerThread, list[int], list[int], int], player: PrefillPlayer
) -> None:
    server, prompt, reference, i = eos_setup
    assert server.instance.eos_token_ids == {reference[i], 2}

    async def body() -> None:
        async with insecure_channel(server.address) as channel:
            client = Client(channel)
            params = SamplingParams(temperature=0, max_tokens=40)
            out = await client.run_request(player, "eos", prompt, params)
            assert out.token_ids == reference[: i + 1]
            assert out.finish_reason == STOP
            out = await client.run_request(player, "ignore-eos", prompt, GREEDY)
            assert out.token_ids == reference
            assert out.finish_reason == LENGTH
            await blocks_back(client, 32)

    server.run(body())


def test_info_describes_the_instance(
    decode_server: DecodeServerThread, player: PrefillPlayer, tiny_model_dir: Path
) -> None:
    async def body() -> None:
        async with insecure_channel(decode_server.address) as channel:
            info = await Client(channel).info()
            assert info.model == tiny_model_dir.name
            assert (info.dtype, info.device, info.attention_backend) == ("float32", "cpu", "torch")
            assert (info.architecture, info.num_experts) == ("Qwen3ForCausalLM", 0)
            assert info.kv_layout == player.layout()
            assert info.kv_layout.model_fingerprint == player.fingerprint
            assert info.kv_layout.block_size == BLOCK_SIZE
            assert info.max_context_tokens == 256
            assert info.max_running == 10
            assert info.num_total_blocks == NUM_BLOCKS
            assert info.kv_cache_bytes == NUM_BLOCKS * 2 * info.kv_layout.num_layers * block_bytes(
                info.kv_layout
            )
            assert info.num_cuda_graphs == 0  # CPU: every step eager

    decode_server.run(body())
