"""The prefill service with its prefix cache: a prompt sharing full blocks with an earlier one
computes only what follows them, still ships every block in the same chunks, and decoding from
what arrived equals single-process generation."""

from __future__ import annotations

import asyncio

import pytest

from mili.engine.generate import generate
from mili.engine.kv.block_pool import blocks_needed
from mili.engine.sampling_params import SamplingParams
from tests.prefill.harness import (
    BLOCK_SIZE,
    TinyModel,
    greedy_continue,
    prefill_request,
    prefill_service,
    random_ids,
    receiver_cache,
    receiver_for,
)

NUM_GENERATED = 12


def expected_chunks(
    steps: list[list[tuple[int, int]]], num_tokens: int, table: list[int], num_layers: int
) -> list[tuple[int, list[int]]]:
    """(layer, decode block ids) of every KV message: per step, layer by layer, each fixed chunk
    of 64 tokens in it (a ship-only chunk (e, e) is the fixed chunk [e - 64, e)) with the blocks
    it completes, the last one with the partial block."""
    order = []
    for step in steps:
        ranges = []
        for start, end in step:
            ship_start = end - 64 if start == end else start // 64 * 64
            first = ship_start // BLOCK_SIZE
            last = blocks_needed(end, BLOCK_SIZE) if end == num_tokens else end // BLOCK_SIZE
            ranges.append(table[first:last])
        order += [(layer, r) for layer in range(num_layers) for r in ranges]
    return order


@pytest.mark.parametrize(
    ("shared", "hit_tokens", "expected_computed"),
    [
        (0, 0, [(0, 64), (64, 128), (128, 150)]),  # nothing shared
        (10, 0, [(0, 64), (64, 128), (128, 150)]),  # part of one block: nothing reusable
        (16, 16, [(16, 64), (64, 128), (128, 150)]),  # exactly one block
        (100, 96, [(64, 64), (96, 128), (128, 150)]),  # six blocks: chunk [0, 64) ship-only
        (150, 144, [(64, 64), (128, 128), (144, 150)]),  # same prompt: 9 blocks, last token again
    ],
)
def test_shared_prefix_is_not_recomputed_and_decoding_equals_generate(
    tiny: TinyModel, shared: int, hit_tokens: int, expected_computed: list[tuple[int, int]]
) -> None:
    vocab = tiny.model.config.vocab_size
    num_layers = tiny.model.config.num_hidden_layers
    first = random_ids(150, vocab, seed=1)
    second = first[:shared] + random_ids(150 - shared, vocab, seed=2)
    params = SamplingParams(temperature=0, max_tokens=NUM_GENERATED, ignore_eos=True)
    expected = generate(tiny.model, [second], params)[0].token_ids

    async def main() -> None:
        async with prefill_service(tiny) as h:
            cache = receiver_cache(tiny)
            async with receiver_for(h, cache=cache) as (receiver, server):
                n = blocks_needed(150 + NUM_GENERATED, BLOCK_SIZE)
                table_a = list(range(n))
                table_b = list(range(n, 2 * n))[::-1]
                receiver.reserve("a", table_a)
                receiver.reserve("b", table_b)
                await h.stub.Prefill(prefill_request("a", first, server.address, table_a))
                reply = await h.stub.Prefill(prefill_request("b", second, server.address, table_b))
                transfer = receiver.transfers["b"]
            steps = [s.chunks for s in h.servicer.worker.steps]
            assert [(c[1], c[2]) for step in steps[3:] for c in step] == expected_computed
            assert transfer.status == "ok"
            assert transfer.header.num_chunks == num_layers * 3
            steps_b = [[(c[1], c[2]) for c in step] for step in steps[3:]]
            assert [(a.layer, a.block_ids) for a in transfer.chunks] == expected_chunks(
                steps_b, 150, table_b, num_layers
            )
            assert reply.first_token_id == expected[0]
            tokens = greedy_continue(
                tiny.model, cache, table_b, 150, reply.first_token_id, NUM_GENERATED
            )
            assert tokens == expected
            cached = h.servicer.worker.prefix_cache_reading()
            assert cached.hit_tokens == hit_tokens
            assert cached.query_tokens == 300
            assert h.servicer.scheduler.prefix_cache.clear() > 0  # the pool is whole again

    asyncio.run(main())


def test_caching_off_computes_everything(tiny: TinyModel) -> None:
    vocab = tiny.model.config.vocab_size
    prompt = random_ids(40, vocab, seed=3)

    async def main() -> None:
        async with prefill_service(tiny, prefix_caching=False) as h:
            async with receiver_for(h, cache=receiver_cache(tiny)) as (receiver, server):
                for rid, offset in (("a", 0), ("b", 10)):
                    table = list(range(offset, offset + 3))
                    receiver.reserve(rid, table)
                    await h.stub.Prefill(prefill_request(rid, prompt, server.address, table))
            assert [s.chunks for s in h.servicer.worker.steps] == [
                (("a", 0, 40),),
                (("b", 0, 40),),
            ]
            assert h.servicer.scheduler.prefix_cache.num_cached == 0

    asyncio.run(main())


def test_a_prefix_still_being_computed_is_reused_chunk_by_chunk(tiny: TinyModel) -> None:
    """Two prompts sharing 140 tokens arrive together: the second reuses each chunk of the
    first as soon as that chunk's step ended, and both decode to their references."""
    vocab = tiny.model.config.vocab_size
    shared = random_ids(140, vocab, seed=5)
    prompts = {
        "a": shared + random_ids(10, vocab, seed=6),
        "b": shared + random_ids(20, vocab, seed=7),
    }
    params = SamplingParams(temperature=0, max_tokens=NUM_GENERATED, ignore_eos=True)
    expected = {rid: generate(tiny.model, [p], params)[0].token_ids for rid, p in prompts.items()}

    async def main() -> None:
        async with prefill_service(tiny, max_batch_tokens=64) as h:
            cache = receiver_cache(tiny, num_blocks=40)
            async with receiver_for(h, cache=cache) as (receiver, server):
                tables = {"a": list(range(0, 12)), "b": list(range(12, 24))}
                calls = {}
                for rid, prompt in prompts.items():
                    receiver.reserve(rid, tables[rid])
                    request = prefill_request(rid, prompt, server.address, tables[rid])
                    calls[rid] = asyncio.ensure_future(h.stub.Prefill(request))
                replies = {rid: await call for rid, call in calls.items()}
            hit = h.servicer.worker.prefix_cache_reading().hit_tokens
            assert 0 < hit <= 128  # b found some of a's chunks computed (at most 8 blocks)
            for rid, prompt in prompts.items():
                assert replies[rid].first_token_id == expected[rid][0]
                tokens = greedy_continue(
                    tiny.model,
                    cache,
                    tables[rid],
                    len(prompt),
                    replies[rid].first_token_id,
                    NUM_GENERATED,
                )
                assert tokens == expected[rid], rid

    asyncio.run(main())


def test_reuse_after_evictions_still_decodes_to_the_reference(tiny: TinyModel) -> None:
    """A pool of 12 blocks: each new 100-token prompt (7 blocks) evicts what the previous left;
    a prompt repeated after that reuses only what survived, and its tokens are still right."""
    vocab = tiny.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=NUM_GENERATED, ignore_eos=True)
    prompts = [random_ids(100, vocab, seed=20 + i) for i in range(3)] + [
        random_ids(100, vocab, seed=20)
    ]

    async def main() -> None:
        async with prefill_service(tiny, num_blocks=12, max_queued_tokens=128) as h:
            for i, prompt in enumerate(prompts):
                cache = receiver_cache(tiny, num_blocks=16)
                async with receiver_for(h, cache=cache) as (receiver, server):
                    table = list(range(16))[::-1][:7]
                    receiver.reserve(f"r{i}", table)
                    reply = await h.stub.Prefill(
                        prefill_request(f"r{i}", prompt, server.address, table)
                    )
                tokens = greedy_continue(
                    tiny.model, cache, table, 100, reply.first_token_id, NUM_GENERATED
                )
                assert tokens == generate(tiny.model, [prompt], params)[0].token_ids, i
            reading = h.servicer.worker.prefix_cache_reading()
            assert reading.evicted_blocks > 0

    asyncio.run(main())
