"""What a sampler graph runs (sampler_graphs.py), on the CPU: the padded batch's draw is the
eager launch's row for row, which batches a graph may take, and the parameter block it reads.
The capture and replay themselves need CUDA: tests/engine/test_sampler_gpu.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mili.engine.constraint.mask import FilledMask
from mili.engine.step.sampler import DrawPlan, Sampler, SamplingParams, SequenceSampling
from mili.engine.step.sampler_graphs import graph_plan, param_block, sample_padded

VOCAB = 805  # three whole 256-column blocks of the draw and a partial one
ROWS = 900  # the model's rows: padding columns past the tokenizer's ids

KINDS = {
    "random": SamplingParams(temperature=1.0),
    "top-p": SamplingParams(temperature=0.7, top_p=0.9),
    "qwen3": SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
    "min-p": SamplingParams(temperature=1.3, min_p=0.05),
    "greedy": SamplingParams(temperature=0.0),
}


def batch(kinds: list[str], seed: int) -> list[SequenceSampling]:
    return [
        SequenceSampling(dataclasses.replace(KINDS[k], seed=seed + i), [1, 2], VOCAB, [3] * i)
        for i, k in enumerate(kinds)
    ]


def random_mask(num_rows: int, seed: int) -> FilledMask:
    """Every row constrained: a random half of the ids allowed (bits past VOCAB clear)."""
    g = np.random.default_rng(seed)
    allowed = g.random((num_rows, VOCAB)) < 0.5
    words = (VOCAB + 31) // 32
    packed = np.packbits(
        np.pad(allowed, ((0, 0), (0, words * 32 - VOCAB))), axis=1, bitorder="little"
    )
    return FilledMask(torch.from_numpy(packed.view(np.int32).copy()), list(range(num_rows)))


def padded_draw(
    logits: torch.Tensor, seqs: list[SequenceSampling], size: int, mask: FilledMask | None
) -> list[int]:
    """What a graph of `size` rows draws for `seqs` (rows past them: other logits, other
    masks), as sampler_graphs replays it: the static rows, the block, the mask's rows."""
    plan = graph_plan(seqs, mask, VOCAB)
    assert plan is not None
    static = torch.randn(size, ROWS) * 4
    static[: len(seqs)] = logits
    block = np.empty((8, size))
    param_block(seqs, VOCAB, block)
    bits = None
    if mask is not None:
        bits = torch.cat([mask.bitmask, random_mask(size - len(seqs), 7).bitmask])
    out = sample_padded(static[:, :VOCAB], torch.from_numpy(block), bits, plan)
    return out[: len(seqs)].tolist()


@pytest.mark.parametrize(
    "kinds",
    [
        ["random"] * 5,
        ["top-p"] * 3,
        ["qwen3"] * 6,
        ["greedy", "random", "min-p", "greedy", "qwen3"],
        ["greedy"] * 3,
        ["random"],  # one row
    ],
)
@pytest.mark.parametrize("masked", [False, True])
def test_the_padded_draw_is_the_eager_launch_row_for_row(kinds: list[str], masked: bool) -> None:
    n = len(kinds)
    for seed in range(4):
        logits = torch.randn(n, ROWS, generator=torch.Generator().manual_seed(seed)) * 3
        seqs = batch(kinds, seed)
        mask = random_mask(n, seed) if masked else None
        eager = Sampler(VOCAB).launch(logits.clone(), seqs, mask).result().token_ids
        for size in (n, n + 3, 24):
            assert padded_draw(logits, seqs, size, mask) == eager
        if mask is not None:
            rows = np.unpackbits(mask.bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
            assert all(rows[i, t] for i, t in enumerate(eager))  # the mask held


def test_a_graph_takes_only_a_batch_whose_sampling_is_the_draw() -> None:
    def one(**kw: object) -> list[SequenceSampling]:
        return [SequenceSampling(SamplingParams(temperature=1.0, **kw), [1], VOCAB)]

    assert graph_plan(one(), None, VOCAB) == DrawPlan(True, False, None)
    assert graph_plan(one(top_k=20), None, VOCAB) == DrawPlan(True, True, 20)
    assert graph_plan(one(top_p=0.9), None, VOCAB) == DrawPlan(True, True, None)  # sorts
    greedy = [SequenceSampling(SamplingParams(temperature=0.0), [1], VOCAB)]
    assert graph_plan(greedy, None, VOCAB) == DrawPlan(False, False, None)
    assert graph_plan(one(), random_mask(1, 0), VOCAB) is not None
    # More than the draw: eager.
    assert graph_plan(one(repetition_penalty=1.1), None, VOCAB) is None
    assert graph_plan(one(logprobs=2), None, VOCAB) is None
    assert graph_plan(one(logit_bias=((3, 1.0),)), None, VOCAB) is None
    held = one(min_tokens=2, stop_token_ids=(5,))
    assert graph_plan(held, None, VOCAB) is None
    held[0].append(1)
    held[0].append(2)  # min_tokens reached: nothing held any more
    assert graph_plan(held, None, VOCAB) is not None
    two = one() + one()
    partial = FilledMask(random_mask(1, 0).bitmask, [1])  # row 1 of 2 constrained
    assert graph_plan(two, partial, VOCAB) is None


def test_the_parameter_block_pads_with_greedy_rows() -> None:
    seqs = batch(["qwen3", "random"], 0)
    out = np.full((8, 4), np.nan)
    param_block(seqs, VOCAB, out)
    assert out[:, 0].tolist()[:4] == [0.6, 20, 0.95, 0.0]
    assert out[:, 1].tolist()[:4] == [1.0, VOCAB, 1.0, 0.0]
    assert 0 <= out[7, 0] < 1 and out[7, 0] == uniform(seqs[0])
    assert out[:, 2:].T.tolist() == [[0.0, VOCAB, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]] * 2


def reference_uniform(seed: int, position: int) -> float:
    """The documented draw of output `position` in Python's integers: splitmix64 of (seed,
    position), its top 52 bits over 2^52."""
    mask = (1 << 64) - 1
    x = (seed + (position + 1) * 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return ((x ^ (x >> 31)) >> 12) / 2.0**52


def uniform(s: SequenceSampling) -> float:
    return reference_uniform(s.seed, len(s.output_token_ids))


def test_the_block_draws_each_rows_uniform_bit_for_bit() -> None:
    """The u row, made for the whole batch at once (numpy's wrapping uint64), is each row's
    reference draw (Python's integers), at seeds up to 2^64 - 1 and late positions."""
    seeds = [0, 1, 2**63, 2**64 - 1, 12345678901234567890, *range(7, 300, 13)]
    seqs = []
    for i, seed in enumerate(seeds):
        s = SequenceSampling(SamplingParams(temperature=0.9, seed=seed), [1], VOCAB)
        for _ in range(i * 37 % 500):
            s.append(3)
        seqs.append(s)
    out = np.empty((8, len(seqs)))
    param_block(seqs, VOCAB, out)
    assert out[7].tolist() == [uniform(s) for s in seqs]
