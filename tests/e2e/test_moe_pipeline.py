"""Qwen3-MoE through the disaggregated pipeline: `mili demo-model --moe`'s checkpoint (per-expert
tensors, sharded) served by real prefill, decode and frontend processes. Greedy tokens equal the
single-process engine's and HF transformers' Qwen3MoeForCausalLM's, with the prefix cache on
(and hit) and off; both engines report the architecture and experts in Info."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mili.engine.generate import generate
from mili.engine.model.loader import load_model, tokenizer_vocab_size
from mili.engine.sampling_params import SamplingParams
from tests.e2e.conftest import Deployment, deploy
from tests.e2e.test_pipeline import NUM_TOKENS, greedy, random_prompt, stream_tokens
from tests.service_process import ServiceProcess

ENGINE_ARGS = ("--dtype", "float32")  # near-flat demo logits: fp32 keeps greedy exact


@pytest.fixture(scope="module")
def moe_pipeline(demo_moe_model_dir: Path, e2e_tokenizer: ServiceProcess) -> Iterator[Deployment]:
    # the dense demo's tokenizer service: the MoE demo carries the same tokenizer files
    d = deploy(demo_moe_model_dir, e2e_tokenizer, engine_args=ENGINE_ARGS)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    # shorter than a block, several blocks, and two that share a 32-token prefix
    shared = random_prompt(32, seed=40)
    return [
        random_prompt(5, seed=41),
        random_prompt(53, seed=42),
        shared + random_prompt(7, seed=43),
        shared + random_prompt(11, seed=44),
    ]


@pytest.fixture(scope="module")
def reference(demo_moe_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Single-process generate(), one prompt at a time, on the same fp32 weights."""
    model = load_model(demo_moe_model_dir, dtype=torch.float32)
    vocab_size = tokenizer_vocab_size(demo_moe_model_dir)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside the services' processes on a small machine
    try:
        return [generate(model, [p], params, vocab_size=vocab_size)[0].token_ids for p in prompts]
    finally:
        torch.set_num_threads(threads)


def test_info_reports_the_architecture(moe_pipeline: Deployment) -> None:
    for info in (moe_pipeline.prefill_info(), moe_pipeline.decode_info()):
        assert info.architecture == "Qwen3MoeForCausalLM"
        assert (info.num_experts, info.num_active_experts) == (8, 2)


def test_single_process_equals_hf(
    demo_moe_model_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        hf = transformers.Qwen3MoeForCausalLM.from_pretrained(
            demo_moe_model_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        vocab_size = tokenizer_vocab_size(demo_moe_model_dir)
        for prompt, tokens in zip(prompts, reference, strict=True):
            with torch.no_grad():
                out = hf.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=NUM_TOKENS,
                    do_sample=False,
                    pad_token_id=0,
                    # the services sample only the tokenizer's ids, never the padding rows
                    suppress_tokens=list(range(vocab_size or 0, hf.config.vocab_size)),
                )
            assert out[0, len(prompt) :].tolist() == tokens, len(prompt)


def test_greedy_equals_single_process_with_prefix_cache_hits(
    moe_pipeline: Deployment, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    for prompt, tokens in zip(prompts, reference, strict=True):
        assert stream_tokens(moe_pipeline, greedy(prompt)) == tokens, len(prompt)
    # again: now every prompt's full blocks come from the prefix caches
    hits = moe_pipeline.decode_info().prefix_cache.hit_tokens
    for prompt, tokens in zip(prompts, reference, strict=True):
        assert stream_tokens(moe_pipeline, greedy(prompt)) == tokens, len(prompt)
    assert moe_pipeline.decode_info().prefix_cache.hit_tokens > hits


def test_greedy_equals_single_process_without_prefix_cache(
    demo_moe_model_dir: Path,
    e2e_tokenizer: ServiceProcess,
    prompts: list[list[int]],
    reference: list[list[int]],
) -> None:
    d = deploy(demo_moe_model_dir, e2e_tokenizer, engine_args=(*ENGINE_ARGS, "--no-prefix-cache"))
    try:
        assert not d.decode_info().prefix_cache.enabled
        for prompt, tokens in zip(prompts, reference, strict=True):
            assert stream_tokens(d, greedy(prompt)) == tokens, len(prompt)
    finally:
        d.stop()
