"""ModelRunner on CPU: padded decode batches (the CUDA-graph shapes, run eagerly) and seeded
sampling that does not depend on the batch around a request."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from mili.engine.engine_config import EngineConfig
from mili.engine.kv.block_pool import BlockPool, blocks_needed
from mili.engine.model.attention import TorchAttention
from mili.engine.model.qwen3 import DecodeBatch, Qwen3ForCausalLM
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.device import use_device
from mili.engine.step.runner import ModelRunner
from mili.engine.step.sampler import SequenceSampling, param_rows
from mili.engine.step.sequence import Sequence
from mili.engine.step.startup import load_runner

BLOCK_SIZE = 4


def prompts(n: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 11, (n,), generator=g).tolist()
    return [torch.randint(3, vocab_size, (k,), generator=g).tolist() for k in lengths]


def start(
    runner: ModelRunner, pool: BlockPool, prompt_ids: list[list[int]], params: list[SamplingParams]
) -> list[Sequence]:
    """Prefill every prompt, sample its first token; each holds blocks for all its tokens."""
    vocab_size = runner.vocab_size
    seqs = []
    for prompt, sp in zip(prompt_ids, params, strict=True):
        s = Sequence.new(prompt, sp, vocab_size=vocab_size, eos_token_ids=[])
        s.block_table = pool.allocate(blocks_needed(len(prompt) + sp.max_tokens, BLOCK_SIZE))
        seqs.append(s)
    logits = runner.prefill(
        [s.prompt_token_ids for s in seqs], [s.block_table for s in seqs], [0] * len(seqs)
    )
    out = runner.sample(logits, [s.sampling for s in seqs]).result()
    for s, token_id in zip(seqs, out.token_ids, strict=True):
        s.append(token_id)
    return seqs


def test_padded_batch_gives_the_real_rows_logits_and_writes_only_the_null_block(
    engine_models: dict[str, Qwen3ForCausalLM],
) -> None:
    model = engine_models["untied_gqa4"]
    runner = ModelRunner.create(model, 40, BLOCK_SIZE, max_decode_batch=8)
    pool = BlockPool(runner.num_blocks, null_block=True)
    assert pool.null_block_id == runner.null_block_id == 40
    vocab_size = model.config.vocab_size
    seqs = start(runner, pool, prompts(3, vocab_size), [SamplingParams(max_tokens=4)] * 3)

    with torch.inference_mode():
        # The old path: a batch of exactly these rows, tables cut to what they hold.
        reference = model.decode(
            DecodeBatch.build(
                [s.output_token_ids[-1] for s in seqs],
                [s.num_tokens - 1 for s in seqs],
                [s.block_table for s in seqs],
                BLOCK_SIZE,
            ),
            runner.kv_cache,
        )
        exact = runner.decode_logits(seqs).clone()
        k_before = [k.clone() for k in runner.kv_cache.k]
        padded = runner.decode_logits(seqs, num_rows=8).clone()  # 5 padded rows, full width

    assert runner.inputs.block_tables[3:8].eq(runner.null_block_id).all()
    torch.testing.assert_close(exact, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(padded, reference, rtol=0, atol=1e-5)
    assert padded.shape == (3, vocab_size)
    # The padded rows wrote their K/V into the null block and nowhere else; the real rows
    # rewrote their own slots (the same values, up to the batch's matmul rounding).
    null = runner.null_block_id
    real = [s.block_table[(p := s.num_tokens - 1) // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for s in seqs]  # fmt: skip
    for before, after in zip(k_before, runner.kv_cache.k, strict=True):
        flat_before, flat_after = before.flatten(0, 1), after.flatten(0, 1)  # [slots, KVH, D]
        torch.testing.assert_close(flat_after[real], flat_before[real], rtol=0, atol=1e-5)
        with torch.inference_mode():  # before is an inference tensor
            flat_before[real] = flat_after[real]
        assert torch.equal(before[:null], after[:null])
        assert not torch.equal(before[null], after[null])


def run_to_end(runner: ModelRunner, seqs: list[Sequence]) -> None:
    while active := [s for s in seqs if not s.is_finished]:
        out = runner.decode(active).result()
        for s, token_id in zip(active, out.token_ids, strict=True):
            s.append(token_id)


def test_seeded_request_samples_the_same_tokens_alone_or_in_a_batch_of_8(
    engine_models: dict[str, Qwen3ForCausalLM],
) -> None:
    model = engine_models["tied_gqa2"]
    vocab_size = model.config.vocab_size
    seeded = SamplingParams(temperature=1.5, top_p=0.95, max_tokens=12, seed=4321)
    others = [
        SamplingParams(max_tokens=5),
        SamplingParams(temperature=1.0, top_k=7, max_tokens=9, seed=1),
        SamplingParams(temperature=0.7, min_p=0.05, max_tokens=12),
        SamplingParams(temperature=1.2, repetition_penalty=1.3, max_tokens=3, seed=4321),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.2, max_tokens=12),
        SamplingParams(temperature=2.0, max_tokens=7),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.8, max_tokens=12, seed=77),
    ]
    prompt_ids = prompts(8, vocab_size, seed=3)

    def tokens(batch: list[int]) -> list[int]:
        runner = ModelRunner.create(model, 64, BLOCK_SIZE, max_decode_batch=8)
        pool = BlockPool(runner.num_blocks, null_block=True)
        params = [seeded if i == 0 else others[i - 1] for i in batch]
        seqs = start(runner, pool, [prompt_ids[i] for i in batch], params)
        run_to_end(runner, seqs)
        return seqs[batch.index(0)].output_token_ids

    alone = tokens([0])
    assert len(alone) == 12 and len(set(alone)) > 4  # sampled, not stuck on one token
    assert tokens(list(range(8))) == alone
    assert tokens([5, 3, 0, 7, 1]) == alone
    # Not trivially equal: another seed samples otherwise.
    seeded = SamplingParams(temperature=1.5, top_p=0.95, max_tokens=12, seed=4322)
    assert tokens([0]) != alone


def test_a_runner_loaded_from_a_checkpoint_samples_only_its_tokenizers_ids(
    demo_model_dir: Path,
) -> None:
    # The demo model pads its embedding table like Qwen3 does: 896 rows for 836 token ids.
    config = EngineConfig(dtype="float32", attention="torch", num_blocks=64, block_size=BLOCK_SIZE)
    runner = load_runner(
        demo_model_dir, config, attention=TorchAttention(), max_decode_batch=8, capture_graphs=False
    )
    assert (runner.vocab_size, runner.model.config.vocab_size) == (836, 896)
    pool = BlockPool(runner.num_blocks, null_block=True)
    hot = [SamplingParams(temperature=2.0, max_tokens=16, seed=i, logprobs=5) for i in range(8)]
    seqs = start(runner, pool, prompts(8, 836), hot)
    run_to_end(runner, seqs)  # 128 draws; ~7% of the mass is on padding rows when unmasked
    drawn = [t for s in seqs for t in s.output_token_ids]
    assert len(drawn) == 128 and max(drawn) < 836
    with pytest.raises(ValueError, match="do not fit"):
        ModelRunner.create(runner.model, 4, BLOCK_SIZE, vocab_size=897)


def test_seeds_reach_the_full_64_bits() -> None:
    """Seeds that differ only above bit 32 draw differently (torch's CPU generator used to
    drop those bits)."""
    a = SequenceSampling(SamplingParams(temperature=1.0, seed=5), [1], 16)
    b = SequenceSampling(SamplingParams(temperature=1.0, seed=5 + (1 << 40)), [1], 16)
    u = param_rows([a, b])[7]  # the draws the sampler sends with the batch
    assert u[0] != u[1]
    assert u.min() >= 0.0 and u.max() < 1.0


def test_a_failed_graph_capture_leaves_the_runner_eager_and_working(
    engine_models: dict[str, Qwen3ForCausalLM], caplog
) -> None:
    # On the CPU every capture fails (CUDA graphs are CUDA's): the same path as a capture a
    # kernel breaks on a GPU. The runner warns, keeps no graphs, and decodes as before.
    model = engine_models["tied_gqa2"]
    runner = ModelRunner.create(model, 32, BLOCK_SIZE, max_decode_batch=4)
    eager = ModelRunner.create(model, 32, BLOCK_SIZE, max_decode_batch=4)
    with caplog.at_level(logging.WARNING, logger="mili.engine"):
        assert runner.capture_graphs() is False
    assert runner.graphs is None
    assert "CUDA graph capture of the decode step failed, decode steps run eagerly" in caplog.text
    prompt_ids = prompts(3, model.config.vocab_size, seed=5)
    outputs = []
    for r in (runner, eager):
        pool = BlockPool(r.num_blocks, null_block=True)
        seqs = start(r, pool, prompt_ids, [SamplingParams(max_tokens=6, temperature=0.0)] * 3)
        run_to_end(r, seqs)
        outputs.append([s.output_token_ids for s in seqs])
    assert outputs[0] == outputs[1] and all(len(ids) == 6 for ids in outputs[0])


@pytest.mark.parametrize(("device", "expected"), [("cuda", 0), ("cuda:1", 1)])
def test_use_device_hands_torch_an_index(
    monkeypatch: pytest.MonkeyPatch, device: str, expected: int
) -> None:
    # torch 2.11's set_device raises ValueError on a device without an index: on the first GPU
    # run every `--device cuda` instance died at start-up there. No GPU here, so the driver
    # calls are recorded instead of made.
    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    use_device(torch.device(device))
    use_device(torch.device("cpu"))
    assert calls == [expected]
