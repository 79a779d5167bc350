"""Single-process generate(): HF-identical greedy tokens, stop rules, logprobs, no leaked blocks."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from mili.engine.generate import generate
from mili.engine.kv.block_pool import BlockPool, BlockPoolExhausted
from mili.engine.model.kv_cache import KVCache
from mili.engine.model.loader import load_model
from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
PROMPT_LENS = [1, 15, 17, 40]


def random_ids(n: int, vocab_size: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n,), generator=g).tolist()


def hf_greedy(hf: Any, prompt: list[int], max_new_tokens: int, **kwargs: Any) -> list[int]:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


def prompts_for(vocab_size: int) -> list[list[int]]:
    return [random_ids(n, vocab_size, seed=700 + n) for n in PROMPT_LENS]


def own_cache(
    model: Qwen3ForCausalLM, num_blocks: int, block_size: int = 16
) -> tuple[KVCache, BlockPool]:
    cache = KVCache(model.config, num_blocks, block_size, dtype=model.dtype)
    return cache, BlockPool(num_blocks)


@pytest.mark.parametrize("name", ["tied_gqa2", "untied_gqa4"])
def test_greedy_64_steps_equal_hf_generate(
    name: str, engine_models: dict[str, Qwen3ForCausalLM], hf_models: dict[str, Any]
) -> None:
    model = engine_models[name]
    prompts = prompts_for(model.config.vocab_size)
    cache, pool = own_cache(model, num_blocks=40)
    results = generate(model, prompts, GREEDY, kv_cache=cache, pool=pool)
    assert pool.num_free == pool.num_blocks
    for prompt, result in zip(prompts, results, strict=True):
        expected = hf_greedy(hf_models[name], prompt, 64, eos_token_id=None)
        assert len(expected) == 64
        assert result.token_ids == expected
        assert result.finish_reason == "length"


def test_block_sizes_and_chunked_prefill_give_same_tokens(
    engine_models: dict[str, Qwen3ForCausalLM],
) -> None:
    model = engine_models["untied_gqa4"]
    prompts = prompts_for(model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = [r.token_ids for r in generate(model, prompts, params, block_size=16)]
    for block_size, chunk in ((1, None), (32, None), (16, 7), (4, 16)):
        cache, pool = own_cache(model, num_blocks=600, block_size=block_size)
        results = generate(
            model, prompts, params, kv_cache=cache, pool=pool, prefill_chunk_size=chunk
        )
        assert [r.token_ids for r in results] == reference, (block_size, chunk)
        assert pool.num_free == pool.num_blocks


def test_eos_and_stop_tokens(tmp_path: Path, checkpoint_dirs: dict[str, Path]) -> None:
    """A checkpoint whose EOS is a token greedy decoding reaches: both engines stop there."""
    transformers = pytest.importorskip("transformers")
    path = shutil.copytree(checkpoint_dirs["tied_gqa2"], tmp_path / "checkpoint")
    prompt = random_ids(12, 256, seed=800)
    tokens = generate(load_model(path), [prompt], GREEDY)[0].token_ids
    eos = tokens[5]
    first = tokens.index(eos)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": [0, eos]}))
    model = load_model(path)

    stopped = generate(model, [prompt], SamplingParams(temperature=0, max_tokens=64))[0]
    assert stopped.token_ids == tokens[: first + 1]  # the EOS token is the last one returned
    assert stopped.finish_reason == "stop"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert hf_greedy(hf, prompt, 64) == stopped.token_ids

    ignored = generate(model, [prompt], GREEDY)[0]
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"

    stop_at = tokens[2]
    params = SamplingParams(
        temperature=0, max_tokens=64, ignore_eos=True, stop_token_ids=(stop_at,)
    )
    by_stop_id = generate(model, [prompt], params)[0]
    assert by_stop_id.token_ids == tokens[: tokens.index(stop_at) + 1]
    assert by_stop_id.finish_reason == "stop"


def test_generation_config_eos_ends_it_as_in_the_services(
    tmp_path: Path, checkpoint_dirs: dict[str, Path]
) -> None:
    """generation_config.json's eos_token_id (Qwen3 chat checkpoints list <|endoftext|> there
    beside config.json's <|im_end|>) stops generate() as it stops prefill and decode: the
    loader gives the model the one EOS set every path reads."""
    path = shutil.copytree(checkpoint_dirs["tied_gqa2"], tmp_path / "checkpoint")
    prompt = random_ids(12, 256, seed=801)
    tokens = generate(load_model(path), [prompt], GREEDY)[0].token_ids
    eos = tokens[4]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, eos]}))
    model = load_model(path)
    assert model.eos_token_ids == {0, eos}
    stopped = generate(model, [prompt], SamplingParams(temperature=0, max_tokens=64))[0]
    assert stopped.token_ids == tokens[: tokens.index(eos) + 1]
    assert stopped.finish_reason == "stop"


def test_max_tokens_per_request_and_pool_back_to_full(
    engine_models: dict[str, Qwen3ForCausalLM],
) -> None:
    model = engine_models["tied_gqa2"]
    prompts = prompts_for(model.config.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 5, 17, 33)]
    cache, pool = own_cache(model, num_blocks=20)
    results = generate(model, prompts, params, kv_cache=cache, pool=pool)
    assert [len(r.token_ids) for r in results] == [1, 5, 17, 33]
    assert all(r.finish_reason == "length" for r in results)
    assert pool.num_free == 20


def test_pool_exhaustion_raises_and_frees_everything(
    engine_models: dict[str, Qwen3ForCausalLM],
) -> None:
    model = engine_models["tied_gqa2"]
    prompts = prompts_for(model.config.vocab_size)
    cache, pool = own_cache(model, num_blocks=8)  # prompts need 1+1+2+3 = 7 blocks, then grow
    with pytest.raises(BlockPoolExhausted):
        generate(model, prompts, GREEDY, kv_cache=cache, pool=pool)
    assert pool.num_free == 8


def test_logprobs_match_hf(
    engine_models: dict[str, Qwen3ForCausalLM], hf_models: dict[str, Any]
) -> None:
    model = engine_models["untied_gqa4"]
    prompt = random_ids(9, model.config.vocab_size, seed=900)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    result = generate(model, [prompt, prompt[:4]], [params, GREEDY])[0]
    with torch.no_grad():
        full = torch.tensor([prompt + result.token_ids[:-1]])
        ref = hf_models["untied_gqa4"](full).logits[0, len(prompt) - 1 :].log_softmax(-1)
    assert result.logprobs is not None and result.top_logprobs is not None
    assert len(result.logprobs) == len(result.top_logprobs) == 12
    for i, token in enumerate(result.token_ids):
        assert result.logprobs[i] == pytest.approx(ref[i, token].item(), abs=1e-4)
        top = result.top_logprobs[i]
        assert len(top) == 3 and top[0][0] == token  # greedy: the chosen token is the top one
        assert [t for t, _ in top] == ref[i].topk(3).indices.tolist()


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_prompt_logprobs_match_hf_and_leave_the_generation_alone(
    engine_models: dict[str, Qwen3ForCausalLM], hf_models: dict[str, Any], chunk_size: int | None
) -> None:
    model = engine_models["untied_gqa4"]
    prompt = random_ids(13, model.config.vocab_size, seed=901)
    other = random_ids(7, model.config.vocab_size, seed=902)
    asking = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=4)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got, beside = generate(model, [prompt, other], [asking, plain], prefill_chunk_size=chunk_size)
    with torch.no_grad():
        ref = hf_models["untied_gqa4"](torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
    assert got.prompt_logprobs is not None and beside.prompt_logprobs is None
    assert len(got.prompt_logprobs) == len(prompt) - 1  # the first token has none
    for i, lp in enumerate(got.prompt_logprobs):
        assert lp.logprob == pytest.approx(ref[i, prompt[i + 1]].item(), abs=1e-4), i
        assert [t for t, _ in lp.top] == ref[i].topk(4).indices.tolist(), i
    # asking changes nothing else: the same tokens as without
    again = generate(model, [prompt, other], plain, prefill_chunk_size=chunk_size)
    assert [r.token_ids for r in (got, beside)] == [r.token_ids for r in again]


def test_seeded_sampling_is_reproducible_and_batch_independent(
    engine_models: dict[str, Qwen3ForCausalLM],
) -> None:
    model = engine_models["tied_gqa2"]
    prompts = prompts_for(model.config.vocab_size)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=7, ignore_eos=True)
    alone = generate(model, prompts[2:3], params)[0].token_ids
    batched = generate(model, prompts, [GREEDY, params, params, params])
    assert batched[2].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=8, ignore_eos=True)
    assert generate(model, prompts[2:3], other_seed)[0].token_ids != alone


def test_bad_requests_are_rejected(engine_models: dict[str, Qwen3ForCausalLM]) -> None:
    model = engine_models["tied_gqa2"]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[5], []], GREEDY)
    with pytest.raises(ValueError, match="context of"):
        generate(model, [[5] * 500], GREEDY)
    with pytest.raises(ValueError, match="2 prompts but 1"):
        generate(model, [[5], [6]], [GREEDY])
    for size in (0, -4):  # an empty chunk was an IndexError deep in the model
        with pytest.raises(ValueError, match=f"prefill_chunk_size must be >= 1, got {size}"):
            generate(model, [[5, 6]], GREEDY, prefill_chunk_size=size)
