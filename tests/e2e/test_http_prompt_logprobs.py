"""vLLM's `prompt_logprobs` on the HTTP API, through the real `openai` SDK (extra_body) against
the float32 pipeline: each prompt token's logprob, its rank in the vocabulary and the k most
likely, in vLLM's format, equal to HF transformers' forward on the demo model; at each
choice of a completion, at the response of a chat; also for a prompt whose prefix prefill has
cached; and vLLM's 400s."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import tokenizers
import torch

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from tests.e2e.conftest import HF_TOL, Deployment, hf_rank_bounds

pytestmark = pytest.mark.slow

HfLogprobs = Callable[[list[int]], torch.Tensor]


@pytest.fixture(scope="module")
def client(pipeline: Deployment) -> openai.OpenAI:
    url = pipeline.frontend.http_url
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))


def random_prompt(n: int, seed: int, vocab: int = 800) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def check_vllm_format(
    entries: list[Any],
    prompt: list[int],
    ref: torch.Tensor,
    k: int,
    tokenizer: tokenizers.Tokenizer,
) -> None:
    """vLLM's prompt_logprobs of `prompt`: null first, then {id: {logprob, rank,
    decoded_token}} with the prompt token first (its rank in the vocabulary) and the k most
    likely (ranks 1..k), each value HF's."""
    assert len(entries) == len(prompt)
    assert entries[0] is None
    for i, entry in enumerate(entries[1:]):
        token, row = prompt[i + 1], ref[i]
        ids = [int(key) for key in entry]
        assert ids[0] == token, i  # the prompt token first
        is_in_top = len(entry) == k  # then it is one of the top k (one entry), else k + 1
        top = ids if is_in_top else ids[1:]
        assert len(top) == k, (i, entry)
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(row[token].item(), abs=HF_TOL), i
        if not is_in_top:  # in the top it has its place's rank, as vLLM writes it
            low, high = hf_rank_bounds(row, token)
            assert low <= mine["rank"] <= high, (i, mine, low, high)
            assert mine["rank"] > k  # the top k are at least as likely
        # The demo model's distributions are nearly flat: near-ties may order differently, so
        # each listed token's value is checked against HF's, and the values against HF's top.
        by_rank = sorted(top, key=lambda t: entry[str(t)]["rank"])
        assert [entry[str(t)]["rank"] for t in by_rank] == list(range(1, k + 1)), i
        values = [entry[str(t)]["logprob"] for t in by_rank]
        assert values == pytest.approx(row.topk(k).values.tolist(), abs=HF_TOL)
        for t in ids:
            assert entry[str(t)]["logprob"] == pytest.approx(row[t].item(), abs=HF_TOL)
            assert entry[str(t)]["decoded_token"] == tokenizer.decode(
                [t], skip_special_tokens=False
            )


def test_completion_prompt_logprobs_equal_hf_even_with_a_cached_prefix(
    pipeline: Deployment,
    client: openai.OpenAI,
    hf_logprobs: HfLogprobs,
    tokenizer: tokenizers.Tokenizer,
) -> None:
    block_size = pipeline.decode_info().kv_layout.block_size
    prompt = random_prompt(3 * block_size + 5, seed=91)
    model = client.models.list().data[0].id
    args: dict[str, Any] = dict(model=model, prompt=prompt, max_tokens=2, temperature=0)
    plain = client.completions.create(**args)
    # not asked: null, as vLLM writes it
    assert (plain.choices[0].model_extra or {}).get("prompt_logprobs", "absent") is None
    # The same prompt again: prefill holds its full blocks in its prefix cache now.
    reply = client.completions.create(**args, extra_body={"prompt_logprobs": 3})
    choice = reply.choices[0]
    assert choice.text == plain.choices[0].text and choice.logprobs is None
    entries = (choice.model_extra or {})["prompt_logprobs"]
    check_vllm_format(entries, prompt, hf_logprobs(prompt), 3, tokenizer)
    # gRPC's chosen_rank is the same number (a prompt token in the top aside: its place there)
    request = generation_pb2.CompleteRequest(
        token_ids=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=1, prompt_logprobs=0)
    )
    grpc_ranks = [
        lp.chosen_rank for lp in pipeline.stub().Complete(request, timeout=60).prompt_logprobs
    ]
    for i, (entry, token) in enumerate(zip(entries[1:], prompt[1:], strict=True)):
        if len(entry) == 4:
            assert entry[str(token)]["rank"] == grpc_ranks[i], i


def test_each_prompt_of_a_batch_gets_its_own_at_every_choice(
    client: openai.OpenAI, hf_logprobs: HfLogprobs, tokenizer: tokenizers.Tokenizer
) -> None:
    prompts = [random_prompt(7, seed=92), random_prompt(5, seed=93)]
    reply = client.completions.create(
        model="",
        prompt=prompts,
        max_tokens=1,
        n=2,
        temperature=0,
        logprobs=1,
        extra_body={"prompt_logprobs": 0},
    )
    assert len(reply.choices) == 4
    for choice in reply.choices:
        prompt = prompts[choice.index // 2]
        entries = (choice.model_extra or {})["prompt_logprobs"]
        check_vllm_format(entries, prompt, hf_logprobs(prompt), 0, tokenizer)
        # without echo, logprobs are the generated token's alone (the prompt's are not echoed)
        assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == 1


def test_chat_prompt_logprobs_sit_at_the_response(
    client: openai.OpenAI,
    hf_logprobs: HfLogprobs,
    tokenizer: tokenizers.Tokenizer,
    demo_model_dir: Path,
) -> None:
    transformers = pytest.importorskip("transformers")
    messages = [{"role": "user", "content": "The quick brown fox"}]
    reply = client.chat.completions.create(
        model="",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=2,
        n=2,
        extra_body={"prompt_logprobs": 2, "chat_template_kwargs": {"enable_thinking": False}},
    )
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(demo_model_dir)
    templated = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=False, tokenize=False
    )
    prompt = hf_tokenizer(templated, add_special_tokens=False)["input_ids"]
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)  # once for n
    entries = (reply.model_extra or {})["prompt_logprobs"]
    check_vllm_format(entries, prompt, hf_logprobs(prompt), 2, tokenizer)
    assert all("prompt_logprobs" not in (c.model_extra or {}) for c in reply.choices)
    assert all(c.logprobs is None for c in reply.choices)  # logprobs were not asked


def test_echo_with_logprobs_answers_them_too_each_with_its_own_top(
    client: openai.OpenAI, hf_logprobs: HfLogprobs, tokenizer: tokenizers.Tokenizer
) -> None:
    """vLLM: echo with logprobs k gives prompt_logprobs k too; prompt_logprobs sent with them
    sets their top apart, the echoed prompt's tokens keep k."""
    prompt = random_prompt(6, seed=94)
    args: dict[str, Any] = dict(model="", prompt=prompt, max_tokens=1, temperature=0, echo=True)
    echoed = client.completions.create(**args, logprobs=1)
    entries = (echoed.choices[0].model_extra or {})["prompt_logprobs"]
    check_vllm_format(entries, prompt, hf_logprobs(prompt), 1, tokenizer)
    # n = 2: only the first choice computes the prompt's logprobs; both show them
    both = client.completions.create(**args, n=2, logprobs=1, extra_body={"prompt_logprobs": 4})
    assert len(both.choices) == 2
    for choice in both.choices:
        entries = (choice.model_extra or {})["prompt_logprobs"]
        check_vllm_format(entries, prompt, hf_logprobs(prompt), 4, tokenizer)
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.top_logprobs is not None
        assert logprobs.tokens is not None and len(logprobs.tokens) == len(prompt) + 1
        tops = logprobs.top_logprobs
        assert tops[0] is None and all(1 <= len(top) <= 2 for top in tops[1:])  # k = 1, + itself
        assert logprobs.token_logprobs is not None
        assert logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(
            [e[str(t)]["logprob"] for e, t in zip(entries[1:], prompt[1:], strict=True)]
        )


def test_vllms_400s_and_a_stream_of_zero(client: openai.OpenAI) -> None:
    for value, says in ((-1, "whole vocabulary"), (-2, "[0, 20]"), (21, "[0, 20]")):
        for create in (
            lambda v: client.completions.create(
                model="", prompt="x", max_tokens=1, extra_body={"prompt_logprobs": v}
            ),
            lambda v: client.chat.completions.create(
                model="",
                messages=[{"role": "user", "content": "x"}],
                max_tokens=1,
                extra_body={"prompt_logprobs": v},
            ),
        ):
            with pytest.raises(openai.BadRequestError) as bad:
                create(value)
            assert bad.value.param == "prompt_logprobs" and says in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(
            model="", prompt="x", max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert bad.value.param == "prompt_logprobs" and "stream" in bad.value.message
    # 0 with stream: accepted, no chunk carries them (vLLM's answer)
    chunks = list(
        client.completions.create(
            model="", prompt="x", max_tokens=2, stream=True, extra_body={"prompt_logprobs": 0}
        )
    )
    assert chunks and all("prompt_logprobs" not in (c.choices[0].model_extra or {})
                          for c in chunks if c.choices)  # fmt: skip


def test_a_whole_body_of_too_many_logprob_entries_is_refused(client: openai.OpenAI) -> None:
    """n x a 4,000-token prompt's prompt_logprobs 20 (and with echo and logprobs, a second copy
    in each choice) past openai_call.MAX_WHOLE_LOGPROBS (1,048,576 entries): a 400 naming the
    limit, where it built 13 copies of 84,000 entries (~90 MB of JSON, several times that in
    objects) in the frontend. Fewer copies of the same prompt still answer."""
    prompt = random_prompt(4000, seed=7)
    asks = [  # (n, echo and logprobs): copies x 4,000 x 21 entries
        (13, False),  # 1,092,000
        (7, True),  # 14 copies: 1,176,000
    ]
    for n, echo in asks:
        extra: dict[str, Any] = {"logprobs": 20, "echo": True} if echo else {}
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(
                model="", prompt=prompt, max_tokens=1, n=n, **extra,
                extra_body={"prompt_logprobs": 20},
            )  # fmt: skip
        assert refused.value.code == "limit_exceeded", refused.value
        assert "over 1,048,576 logprob entries" in refused.value.message
    answered = client.completions.create(
        model="", prompt=prompt, max_tokens=1, n=2, extra_body={"prompt_logprobs": 20}
    )
    assert [len(c.model_extra["prompt_logprobs"]) for c in answered.choices] == [4000, 4000]


def test_lm_eval_loglikelihood_requests_score_what_hf_scores(
    client: openai.OpenAI, hf_logprobs: HfLogprobs
) -> None:
    """lm-eval's `local-completions` loglikelihood batch (prompts of ids, echo, logprobs 1,
    max_tokens 1, temperature 0, a seed): each prompt token's logprob is HF's log_softmax over
    all the model's rows (the demo model's 60 padding rows hold ~7% of the mass: normalized
    over the tokenizer's ids alone it was ~0.07 higher a token) and lm-eval's is_greedy (the
    token's logprob is the top one's) is HF's argmax; so is the generated token's."""
    greedy = random_prompt(4, seed=94)
    for _ in range(4):  # a continuation that is the model's greedy one: is_greedy holds
        greedy.append(int(hf_logprobs([*greedy, 0])[-1].argmax()))
    prompts = [greedy, random_prompt(9, seed=95)]
    reply = client.completions.create(
        model="", prompt=prompts, max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234
    )
    assert sorted(c.index for c in reply.choices) == [0, 1]
    for choice in reply.choices:
        prompt = prompts[choice.index]
        ref = hf_logprobs(prompt)  # [n - 1, vocab]
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.token_logprobs and logprobs.top_logprobs
        values, tops = logprobs.token_logprobs, logprobs.top_logprobs
        assert len(values) == len(prompt) + 1 and values[0] is None
        expected = ref.gather(1, torch.tensor(prompt[1:]).unsqueeze(-1)).squeeze(-1).tolist()
        assert values[1 : len(prompt)] == pytest.approx(expected, abs=HF_TOL)
        is_greedy = [v == max(top.values()) for v, top in zip(values[1:], tops[1:], strict=True)]
        hf_greedy = (ref.argmax(-1) == torch.tensor(prompt[1:])).tolist()
        assert is_greedy[: len(prompt) - 1] == hf_greedy
        last = hf_logprobs([*prompt, 0])[-1]  # the generated (greedy) token's distribution
        assert values[-1] == pytest.approx(last.max().item(), abs=HF_TOL) and is_greedy[-1]
        if choice.index == 0:
            assert all(is_greedy[3:7])  # the 4 greedy tokens appended
