"""Prefill steps replayed from CUDA graphs (prefill_graphs.py) compute what eager steps compute,
over the Mojo GPU kernels (graph-safe: the torch reference's prefill reads lengths on the host).

Marked gpu; benchmarks/gpu_check.sh runs it with the other new paths. On the CPU,
tests/engine/test_prefill_inputs.py checks the padded step's logits and KV the same way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.choice import Kernels, select_kernels
from kernels.self_check import CheckShape
from mili.engine.engine_config import EngineConfig
from mili.engine.model.config import Qwen3Config
from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.step.prompt_logprobs import PromptLogprobsAsk, chunk_targets
from mili.engine.step.runner import ModelRunner
from mili.engine.step.sampler import SamplingParams, SequenceSampling
from mili.engine.step.startup import load_runner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BLOCK_SIZE = 16
# head_dim 64: the Mojo GPU kernels' smallest
CONFIG = Qwen3Config(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    torch_dtype="float32",
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mili.engine.model.checkpoint import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("m") / "m", CONFIG, seed=1, std=0.1)


@pytest.fixture(scope="module")
def kernels() -> Kernels:
    """What `--attention auto` runs for CONFIG in float32 (self-checked in this process)."""
    found = select_kernels(
        "auto", "cuda", CheckShape.of(CONFIG, BLOCK_SIZE, "float32"), isolate=False
    )
    if not (getattr(found.attention, "is_graph_safe", False) and found.fused_ops.is_graph_safe):
        pytest.skip(f"no graph-safe kernels here: {found.attention}, {found.fused_ops.name}")
    return found


@pytest.fixture(scope="module")
def gpu_model(checkpoint: Path, kernels: Kernels) -> Qwen3ForCausalLM:
    from mili.engine.model.loader import load_model

    return load_model(
        checkpoint,
        device="cuda",
        dtype=torch.float32,
        attention=kernels.attention,
        fused_ops=kernels.fused_ops,
    )


def chunks_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in lengths]


def test_prefill_steps_replayed_from_graphs_compute_the_eager_logits_and_kv(
    gpu_model: Qwen3ForCausalLM,
) -> None:
    """Steps of 1 to 16 chunks, one continuing a cached prefix, padded to the captured token
    counts: each chunk's last-token logits and its blocks' K/V are the eager step's; a step
    of 17 chunks, one asking prompt logprobs and one with a layer callback run eagerly."""
    graphed = ModelRunner.create(gpu_model, 128, BLOCK_SIZE)
    eager = ModelRunner.create(gpu_model, 128, BLOCK_SIZE)
    assert graphed.capture_prefill_graphs(256), "the capture or its check failed (the warning)"
    graphs = graphed.prefill_graphs
    assert graphs is not None and graphs.token_sizes == (16, 32, 64, 128, 256)
    prefix = chunks_of([37], 0)[0]  # 37 tokens cached before the second chunk of step 2
    for runner in (graphed, eager):
        runner.prefill([prefix], [[10, 11, 12]], [0])
    steps = [
        ([5], [[0]], [0]),
        ([20, 11, 40], [[1, 2], [10, 11, 12, 13], [3, 4, 5]], [0, 37, 0]),
        ([1] * 16, [[20 + i] for i in range(16)], [0] * 16),
        ([200], [list(range(40, 53))], [0]),
    ]
    for seed, (lengths, tables, starts) in enumerate(steps):
        chunks = chunks_of(lengths, seed + 1)
        got = graphed.prefill_step(chunks, tables, starts).logits.clone()
        expected = eager.prefill_step(chunks, tables, starts).logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        blocks = torch.tensor([b for t in tables for b in t], device="cuda")
        for cache in ("k", "v"):
            a, b = getattr(graphed.kv_cache, cache), getattr(eager.kv_cache, cache)
            for layer in range(CONFIG.num_hidden_layers):
                torch.testing.assert_close(a[layer][blocks], b[layer][blocks])
    assert graphs.num_replays == len(steps)

    # Steps a graph does not take: they run eagerly, and still compute the same logits.
    too_many = chunks_of([1] * 17, 9)
    tables17 = [[60 + i] for i in range(17)]
    torch.testing.assert_close(
        graphed.prefill_step(too_many, tables17, [0] * 17).logits,
        eager.prefill_step(too_many, tables17, [0] * 17).logits,
        rtol=1e-4,
        atol=1e-4,
    )
    prompt = chunks_of([9], 10)[0]
    ask = PromptLogprobsAsk(0, chunk_targets(prompt, 0, 9), 2)
    out = graphed.prefill_step([prompt], [[90]], [0], prompt_logprobs=[ask])
    assert len(out.prompt_logprobs) == 1
    layers: list[int] = []
    graphed.prefill_step([prompt], [[91]], [0], layer_callback=layers.append)
    assert layers == list(range(CONFIG.num_hidden_layers))
    assert graphs.num_replays == len(steps)  # none of the three replayed


def test_first_tokens_sampled_from_the_prefill_graphs_logits_replay_too(
    gpu_model: Qwen3ForCausalLM,
) -> None:
    """The first tokens of a step whose chunks all finish are sampled from the prefill graphs'
    static logits (the worker passes them as they are): by a sampler graph from the third such
    step of a batch size on (sampler_graphs.py), drawing what the eager sampler draws."""
    runner = ModelRunner.create(gpu_model, 128, BLOCK_SIZE)
    assert runner.capture_prefill_graphs(256)
    sampler_graphs = runner.prefill_sampler_graphs
    assert sampler_graphs is not None
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    for step in range(4):
        chunks = chunks_of([7, 30, 2], 20 + step)
        logits = runner.prefill_step(chunks, [[0], [1, 2], [3]], [0, 0, 0]).logits
        seqs = [SequenceSampling(params, chunk, CONFIG.vocab_size) for chunk in chunks]
        expected = runner.sampler(logits.clone(), seqs).token_ids
        assert runner.sample(logits, seqs).result().token_ids == expected
    assert sampler_graphs.num_graphs == 1 and sampler_graphs.num_replays == 2


def test_a_runner_loaded_for_prefill_captures_its_graphs(
    checkpoint: Path, kernels: Kernels
) -> None:
    """load_runner(capture_prefill_graphs=True), as the prefill service loads it: graphs up
    to its max_prefill_tokens, checked at start-up; with --enforce-eager none."""
    for enforce_eager in (False, True):
        config = EngineConfig(
            device="cuda", dtype="float32", num_blocks=64, enforce_eager=enforce_eager
        )
        runner = load_runner(
            checkpoint,
            config,
            attention=kernels.attention,
            fused_ops=kernels.fused_ops,
            max_decode_batch=1,
            capture_graphs=False,
            capture_prefill_graphs=True,
            max_prefill_tokens=512,
        )
        if enforce_eager:
            assert runner.prefill_graphs is None
        else:
            assert runner.prefill_graphs is not None
            assert runner.prefill_graphs.token_sizes[-1] == 512


def test_bf16_steps_replayed_from_graphs_match_the_eager_logits(checkpoint: Path) -> None:
    """bf16, where flash_prefill (tensor cores) runs: steps padded to the captured counts give
    the eager steps' logits to bf16's rounding (GEMMs of other shapes round otherwise; a broken
    padding rule is off by units)."""
    from mili.engine.model.loader import load_model

    found = select_kernels(
        "auto", "cuda", CheckShape.of(CONFIG, BLOCK_SIZE, "bfloat16"), isolate=False
    )
    if not (getattr(found.attention, "is_graph_safe", False) and found.fused_ops.is_graph_safe):
        pytest.skip(f"no graph-safe bf16 kernels here: {found.attention}")
    model = load_model(
        checkpoint,
        device="cuda",
        dtype=torch.bfloat16,
        attention=found.attention,
        fused_ops=found.fused_ops,
    )
    graphed = ModelRunner.create(model, 128, BLOCK_SIZE)
    eager = ModelRunner.create(model, 128, BLOCK_SIZE)
    assert graphed.capture_prefill_graphs(256), "the capture or its check failed (the warning)"
    for seed, lengths in enumerate([[5], [20, 11, 40], [1] * 16, [200]]):
        chunks = chunks_of(lengths, seed + 30)
        tables, first = [], 0
        for n in lengths:
            tables.append(list(range(first, first + -(-n // BLOCK_SIZE))))
            first += len(tables[-1])
        got = graphed.prefill_step(chunks, tables, [0] * len(chunks)).logits.clone()
        expected = eager.prefill_step(chunks, tables, [0] * len(chunks)).logits
        scale = expected.abs().max().item()
        assert (got - expected).abs().max().item() <= 3e-2 * scale, lengths
    assert graphed.prefill_graphs is not None and graphed.prefill_graphs.num_replays == 4
