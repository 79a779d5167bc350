"""Prompt logprobs end to end (tokenizer, prefill, decode and frontend processes, float32): gRPC
Complete and Generate return one entry per prompt token after the first, equal to HF
transformers' on the demo model (logprobs, top tokens and the prompt token's rank), also for a
prompt whose prefix prefill has cached."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import torch

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from mili.rpc.status import bad_request_of
from tests.e2e.conftest import HF_TOL as TOL
from tests.e2e.conftest import Deployment, hf_rank_bounds


def random_prompt(n: int, seed: int, vocab: int = 800) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def sampling(**fields: int) -> sampling_pb2.SamplingParams:
    fields = {"max_tokens": 2, **fields}
    return sampling_pb2.SamplingParams(temperature=0.0, ignore_eos=True, **fields)


def check_against(ref: torch.Tensor, prompt: list[int], entries: Any, num_top: int) -> None:
    assert len(entries) == len(prompt) - 1
    for i, lp in enumerate(entries):
        assert lp.chosen.token_id == prompt[i + 1]
        assert lp.chosen.logprob == pytest.approx(ref[i, prompt[i + 1]].item(), abs=TOL), i
        # The demo model's distributions are nearly flat: near-ties may order differently, so
        # each listed token's value is checked, and the values against HF's top-n.
        assert len(lp.top) == num_top
        assert [t.logprob for t in lp.top] == pytest.approx(ref[i].topk(num_top).values, abs=TOL)
        for t in lp.top:
            assert t.logprob == pytest.approx(ref[i, t.token_id].item(), abs=TOL)
        low, high = hf_rank_bounds(ref[i], prompt[i + 1])
        assert low <= lp.chosen_rank <= high, (i, lp.chosen_rank, low, high)


def test_complete_returns_prompt_logprobs_equal_to_hf_even_with_a_cached_prefix(
    pipeline: Deployment, hf_logprobs: Any
) -> None:
    block_size = pipeline.decode_info().kv_layout.block_size
    prompt = random_prompt(3 * block_size + 5, seed=77)
    stub = pipeline.stub()
    plain = stub.Complete(
        generation_pb2.CompleteRequest(token_ids=prompt, sampling=sampling()), timeout=60
    )
    assert not plain.prompt_logprobs  # not asked: none
    # The same prompt again: prefill holds its full blocks in its prefix cache now.
    reply = stub.Complete(
        generation_pb2.CompleteRequest(token_ids=prompt, sampling=sampling(prompt_logprobs=3)),
        timeout=60,
    )
    check_against(hf_logprobs(prompt), prompt, reply.prompt_logprobs, 3)
    assert list(reply.token_ids) == list(plain.token_ids)
    assert reply.usage.prompt_tokens == len(prompt)


def test_generate_sends_them_on_the_first_message_only(
    pipeline: Deployment, hf_logprobs: Any
) -> None:
    prompt = random_prompt(9, seed=78)
    request = generation_pb2.GenerateRequest(
        token_ids=prompt, sampling=sampling(prompt_logprobs=0, max_tokens=4)
    )
    responses = list(pipeline.stub().Generate(request, timeout=60))
    check_against(hf_logprobs(prompt), prompt, responses[0].prompt_logprobs, 0)
    assert all(not r.prompt_logprobs for r in responses[1:])
    # A one-token prompt has no prompt logprobs (nothing precedes its token).
    one = list(pipeline.stub().Generate(
        generation_pb2.GenerateRequest(token_ids=[5], sampling=sampling(prompt_logprobs=2)),
        timeout=60,
    ))  # fmt: skip
    assert all(not r.prompt_logprobs for r in one) and one[-1].usage.completion_tokens == 2


def test_a_text_prompt_gets_one_per_token_after_the_first(pipeline: Deployment) -> None:
    request = generation_pb2.CompleteRequest(
        prompt="The quick brown fox jumps", sampling=sampling(prompt_logprobs=1)
    )
    reply = pipeline.stub().Complete(request, timeout=60)
    assert len(reply.prompt_logprobs) == reply.usage.prompt_tokens - 1 > 0
    assert all(len(lp.top) == 1 and lp.chosen.logprob <= 0 for lp in reply.prompt_logprobs)


@pytest.mark.parametrize("value", [-1, 21])
def test_out_of_range_is_invalid_argument_naming_the_field(
    pipeline: Deployment, value: int
) -> None:
    request = generation_pb2.CompleteRequest(
        token_ids=[1, 2, 3], sampling=sampling(prompt_logprobs=value)
    )
    with pytest.raises(grpc.RpcError) as info:
        pipeline.stub().Complete(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    bad = bad_request_of(info.value)
    assert bad is not None
    assert [v.field for v in bad.field_violations] == ["sampling.prompt_logprobs"]
