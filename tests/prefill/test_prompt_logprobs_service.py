"""Prompt logprobs through the prefill service: every position, across chunks, even when the
prompt's prefix is cached, equal to the model's own full-prompt logits (which
tests/engine/test_prompt_logprobs.py checks against HF transformers); the limits refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from mili.engine import sampling_params
from mili.engine.kv.block_pool import blocks_needed
from mili.engine.model.kv_cache import KVCache
from mili.engine.model.qwen3 import PrefillBatch
from tests.prefill.harness import (
    BLOCK_SIZE,
    TinyModel,
    prefill_request,
    prefill_service,
    random_ids,
    receiver_for,
)


def reference_logprobs(tiny: TinyModel, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: the whole prompt in one forward, row i - 1 for token i."""
    cache = KVCache(tiny.model.config, blocks_needed(len(prompt), BLOCK_SIZE), BLOCK_SIZE)
    table = list(range(cache.num_blocks))
    batch = PrefillBatch.build([prompt], [table], BLOCK_SIZE)
    return tiny.model.prefill(batch, cache, all_logits=True)[:-1].log_softmax(-1)


def test_prompt_logprobs_cover_every_position_across_chunks_and_a_cached_prefix(
    tiny: TinyModel,
) -> None:
    prompt = random_ids(150, tiny.model.config.vocab_size, seed=40)  # [0,64) [64,128) [128,150)
    ref = reference_logprobs(tiny, prompt)

    async def main() -> None:
        async with prefill_service(tiny) as h, receiver_for(h) as (receiver, server):
            table_a, table_b = list(range(10)), list(range(10, 20))
            receiver.reserve("a", table_a)
            receiver.reserve("b", table_b)
            plain = await h.stub.Prefill(prefill_request("a", prompt, server.address, table_a))
            assert not plain.prompt_logprobs  # not asked: none
            # The same prompt again: its first 144 tokens are cached now, yet prompt logprobs
            # need every position's logits, so all of it is computed.
            request = prefill_request("b", prompt, server.address, table_b, prompt_logprobs=3)
            reply = await h.stub.Prefill(request)
            assert receiver.transfers["b"].status == "ok"
            steps = [s.chunks for s in h.servicer.worker.steps]
            assert [c[1:] for step in steps[3:] for c in step] == [(0, 64), (64, 128), (128, 150)]
            assert reply.num_cached_tokens == 0
            assert reply.first_token_id == plain.first_token_id
            assert h.servicer.scheduler.prefix_cache.clear() > 0  # the pool is whole again

        assert len(reply.prompt_logprobs) == len(prompt) - 1
        for i, lp in enumerate(reply.prompt_logprobs):
            assert lp.chosen.token_id == prompt[i + 1]
            assert lp.chosen.logprob == pytest.approx(ref[i, prompt[i + 1]].item(), abs=1e-4)
            values, ids = ref[i].topk(3)
            assert [t.token_id for t in lp.top] == ids.tolist()
            assert [t.logprob for t in lp.top] == pytest.approx(values.tolist(), abs=1e-4)

    asyncio.run(main())


def test_prompt_logprobs_out_of_range_or_for_too_long_a_prompt_are_refused(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sampling_params, "MAX_PROMPT_LOGPROBS_TOKENS", 8)
    prompt = random_ids(9, tiny.model.config.vocab_size, seed=41)

    async def main() -> None:
        async with prefill_service(tiny) as h:
            for value, words in [(21, "must be unset or in [0, 20]"), (-1, "[0, 20]"), (2, "8")]:
                request = prefill_request("r", prompt, "127.0.0.1:9", [0], prompt_logprobs=value)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await h.stub.Prefill(request, timeout=10)
                assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                details = caught.value.details() or ""
                assert "sampling.prompt_logprobs" in details and words in details

    asyncio.run(main())
