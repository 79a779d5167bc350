"""The prefill service over real gRPC, streaming KV to a real receiver: what arrives, in what
order and when, and that decoding from the received KV equals single-process generation."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mili.engine.generate import generate
from mili.engine.kv.block_pool import blocks_needed
from mili.engine.sampling_params import SamplingParams
from mili.pb.prefill.v1 import prefill_pb2
from mili.rpc.kv_layout import block_bytes
from tests.prefill.harness import (
    BLOCK_SIZE,
    TinyModel,
    greedy_continue,
    prefill_request,
    prefill_service,
    random_ids,
    receiver_cache,
    receiver_for,
    until,
)

NUM_GENERATED = 33


def reference(tiny: TinyModel, prompt: list[int], max_tokens: int = NUM_GENERATED) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return generate(tiny.model, [prompt], params)[0].token_ids


def reservation(receiver_blocks: int, num_tokens: int, offset: int) -> list[int]:
    """Decode-side block ids, deliberately not 0, 1, 2, ...: descending from an offset."""
    n = blocks_needed(num_tokens, BLOCK_SIZE)
    return [(offset + receiver_blocks - 1 - i) % receiver_blocks for i in range(n)]


# Shorter than a block, exactly a block, several blocks, and longer than max_batch_tokens (64):
# chunks [0, 64) [64, 128) [128, 150).
@pytest.mark.parametrize("num_tokens", [5, 16, 50, 150])
def test_decoding_from_transferred_kv_equals_generate(tiny: TinyModel, num_tokens: int) -> None:
    prompt = random_ids(num_tokens, tiny.model.config.vocab_size, seed=num_tokens)
    expected = reference(tiny, prompt)
    num_layers = tiny.model.config.num_hidden_layers

    async def main() -> None:
        async with prefill_service(tiny) as h:
            cache = receiver_cache(tiny)
            async with receiver_for(h, cache=cache) as (receiver, server):
                # Room for the prompt and what decode will generate after it.
                table = reservation(cache.num_blocks, num_tokens + NUM_GENERATED, offset=7)
                receiver.reserve("r1", table)
                reply = await h.stub.Prefill(prefill_request("r1", prompt, server.address, table))
                transfer = receiver.transfers["r1"]

        chunks = h.servicer.scheduler.chunk_bounds(num_tokens)
        assert transfer.status == "ok"
        assert transfer.header.num_tokens == num_tokens
        assert transfer.header.num_chunks == num_layers * len(chunks)
        # One message per layer per prompt chunk, layer by layer, each carrying the blocks that
        # prompt chunk completed (the last one with the partial block), at decode's block ids.
        expected_order = []
        for start, end in chunks:
            first = start // BLOCK_SIZE
            last = blocks_needed(end, BLOCK_SIZE) if end == num_tokens else end // BLOCK_SIZE
            expected_order += [(layer, table[first:last]) for layer in range(num_layers)]
        assert [(a.layer, a.block_ids) for a in transfer.chunks] == expected_order
        assert [a.seq for a in transfer.chunks] == list(range(len(expected_order)))
        total_blocks = blocks_needed(num_tokens, BLOCK_SIZE)
        assert reply.kv_bytes == num_layers * 2 * total_blocks * block_bytes(h.servicer.layout)
        assert reply.num_prompt_tokens == num_tokens
        assert reply.compute_ms > 0 and reply.transfer_ms > 0 and reply.queue_ms >= 0
        assert transfer.commit is not None
        assert reply.first_token_id == transfer.commit.first_token_id == expected[0]
        tokens = greedy_continue(
            tiny.model, cache, table, num_tokens, reply.first_token_id, NUM_GENERATED
        )
        assert tokens == expected

    asyncio.run(main())


def test_min_tokens_holds_the_models_eos_back_from_the_first_token(tiny: TinyModel) -> None:
    """The first token's stop set is decode's: the request's stop ids and the model's EOS (not
    only what the frontend merged into the stop ids), unless ignore_eos."""
    prompt = random_ids(12, tiny.model.config.vocab_size, seed=12)
    greedy = reference(tiny, prompt, max_tokens=1)[0]

    async def first(**sampling: Any) -> int:
        async with (
            prefill_service(tiny, eos_token_ids=(greedy,)) as h,
            receiver_for(h) as (receiver, server),
        ):
            table = reservation(96, len(prompt) + 4, offset=0)
            receiver.reserve("r", table)
            request = prefill_request("r", prompt, server.address, table, **sampling)
            return (await h.stub.Prefill(request)).first_token_id

    assert asyncio.run(first(max_tokens=4)) == greedy  # no min_tokens: EOS may come first
    assert asyncio.run(first(max_tokens=4, min_tokens=2)) != greedy
    assert asyncio.run(first(max_tokens=4, min_tokens=2, ignore_eos=True)) == greedy


def test_concurrent_prompts_share_forwards(tiny: TinyModel) -> None:
    vocab = tiny.model.config.vocab_size
    # "long" keeps the worker busy for four full forwards (chunks of 64) and a last one of 8;
    # the others arrive during its first and all ride in the next forward (9 + 17 + 20 = 46
    # <= 64), ahead of long's second chunk: they do not wait for every chunk of long.
    lengths = {"long": 264, "a": 9, "b": 17, "c": 20}
    prompts = {rid: random_ids(n, vocab, seed=100 + n) for rid, n in lengths.items()}

    async def main() -> dict[str, prefill_pb2.PrefillResponse]:
        async with prefill_service(tiny) as h:
            worker = h.servicer.worker
            async with receiver_for(h, cache=receiver_cache(tiny)) as (receiver, server):
                calls = {}
                offset = 0
                for rid, prompt in prompts.items():
                    n = blocks_needed(len(prompt), BLOCK_SIZE)
                    table = list(range(offset, offset + n))
                    offset += n
                    receiver.reserve(rid, table)
                    request = prefill_request(rid, prompt, server.address, table)
                    calls[rid] = asyncio.ensure_future(h.stub.Prefill(request))
                    if rid == "long":
                        await until(lambda: len(worker.steps) >= 1)
                replies = {rid: await call for rid, call in calls.items()}
            steps = [s.chunks for s in worker.steps]
        assert steps[0] == (("long", 0, 64),)
        assert sorted(steps[1]) == [("a", 0, 9), ("b", 0, 17), ("c", 0, 20)]
        assert steps[2:] == [
            *((("long", s, s + 64),) for s in range(64, 256, 64)),
            (("long", 256, 264),),
        ]
        return replies

    replies = asyncio.run(main())
    for rid, prompt in prompts.items():
        assert replies[rid].first_token_id == reference(tiny, prompt, max_tokens=1)[0]


def test_layers_stream_while_the_forward_is_computing(tiny: TinyModel) -> None:
    """Layer i's chunk is on decode's side before the last layer has been computed."""
    prompt = random_ids(512, tiny.model.config.vocab_size, seed=5)
    num_layers = tiny.model.config.num_hidden_layers

    async def main() -> None:
        async with prefill_service(tiny, num_blocks=64, max_batch_tokens=512) as h:
            async with receiver_for(h, cache=receiver_cache(tiny, 64)) as (receiver, server):
                table = list(range(32))
                receiver.reserve("big", table)
                await h.stub.Prefill(prefill_request("big", prompt, server.address, table))
            (step,) = h.servicer.worker.steps  # one forward: 512 tokens fit the budget
        arrivals = receiver.transfers["big"].chunks
        assert [a.layer for a in arrivals] == list(range(num_layers))
        assert len(step.layer_done_at) == num_layers
        margin_ms = (step.layer_done_at[-1] - arrivals[0].at) * 1e3
        assert margin_ms > 0, f"layer 0 arrived {-margin_ms:.1f} ms after the last layer"

    asyncio.run(main())


def test_info_describes_model_layout_limits_and_load(tiny: TinyModel) -> None:
    async def main() -> None:
        async with prefill_service(tiny, num_blocks=40, max_queued_tokens=300) as h:
            info = await h.stub.Info(prefill_pb2.InfoRequest())
            assert info.model == tiny.path.name
            assert info.dtype == "float32" and info.device == "cpu"
            assert info.attention_backend == "torch"
            assert info.num_cuda_graphs == 0  # CPU: every prefill step eager
            assert (info.architecture, info.num_experts, info.num_active_experts) == (
                "Qwen3ForCausalLM", 0, 0,
            )  # fmt: skip
            layout = info.kv_layout
            assert (layout.block_size, layout.num_layers, layout.num_kv_heads) == (16, 8, 2)
            assert (layout.head_dim, layout.dtype) == (64, "float32")
            assert layout.block_order == "block,slot,head,dim"
            assert layout.model_fingerprint == tiny.fingerprint
            assert info.max_prompt_tokens == 300  # min(context 1024, queue 300, pool 640)
            assert info.max_batch_tokens == 64
            assert info.num_queued_tokens == 0
            assert info.num_total_blocks == info.num_free_blocks == 40
            assert info.kv_cache_bytes == 40 * 2 * layout.num_layers * block_bytes(layout)

    asyncio.run(main())


def test_logprobs_come_back_in_the_response_and_the_commit(tiny: TinyModel) -> None:
    prompt = random_ids(20, tiny.model.config.vocab_size, seed=20)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    expected = generate(tiny.model, [prompt], params)[0]

    async def main() -> None:
        async with prefill_service(tiny) as h, receiver_for(h) as (receiver, server):
            receiver.reserve("lp", [3, 4])
            request = prefill_request("lp", prompt, server.address, [3, 4], logprobs=3)
            reply = await h.stub.Prefill(request)
        commit = receiver.transfers["lp"].commit
        assert commit is not None and commit.first_logprobs == reply.first_logprobs
        assert reply.first_logprobs.chosen.token_id == expected.token_ids[0]
        assert expected.logprobs is not None and expected.top_logprobs is not None
        assert reply.first_logprobs.chosen.logprob == pytest.approx(expected.logprobs[0])
        top = [(t.token_id, t.logprob) for t in reply.first_logprobs.top]
        assert [t for t, _ in top] == [t for t, _ in expected.top_logprobs[0]]

    asyncio.run(main())
