"""ModelRunner on a CUDA GPU: CUDA-graph replay = eager, and no host sync inside a step.

The graphs here run over the torch reference's decode marked graph-safe (`CapturableTorch`):
over full-width block tables it has fixed shapes and no host syncs, so it captures (slowly:
it gathers every block of the width); this tests the graph machinery independently of the
Mojo GPU kernels, which declare `is_graph_safe` themselves.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from mili.engine.constraint.mask import FilledMask
from mili.engine.kv.block_pool import BlockPool, blocks_needed
from mili.engine.model.attention import TorchAttention
from mili.engine.model.loader import load_model
from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.ahead_check import check_ahead
from mili.engine.step.runner import Launched, ModelRunner
from mili.engine.step.sequence import Sequence
from tests.engine.greedy_divergence import describe_divergence
from tests.engine.test_runner_ahead import run_ahead

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BLOCK_SIZE = 16
MAX_TOKENS = 8


class CapturableTorch(TorchAttention):
    is_graph_safe = True


@pytest.fixture(scope="module")
def cuda_model(checkpoint_dirs: dict[str, Path]) -> Qwen3ForCausalLM:
    model = load_model(checkpoint_dirs["untied_gqa4"], device="cuda", dtype=torch.float32)
    model.attention = CapturableTorch()
    # Keep the full block-table width (max context / block size) small for the torch gather.
    model.config = dataclasses.replace(model.config, max_position_embeddings=256)
    return model


def started(runner: ModelRunner, batch: int) -> tuple[list[Sequence], torch.Tensor]:
    """`batch` greedy sequences of random prompts (seeded by `batch`), prefilled, each with
    its first token (no EOS, one max_tokens), and the prefill's logits on the host."""
    vocab_size = runner.model.config.vocab_size
    g = torch.Generator().manual_seed(batch)
    pool = BlockPool(runner.num_blocks, null_block=True)
    seqs = []
    for _ in range(batch):
        prompt = torch.randint(3, vocab_size, (int(torch.randint(4, 40, (1,), generator=g)),),
                               generator=g).tolist()  # fmt: skip
        # Greedy: the default (T=1, no seed) draws with a fresh random seed in each run.
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        s = Sequence.new(prompt, greedy, vocab_size=vocab_size, eos_token_ids=[])
        s.block_table = pool.allocate(blocks_needed(len(prompt) + MAX_TOKENS, BLOCK_SIZE))
        seqs.append(s)
    return seqs, prefill_first_tokens(runner, seqs)


def prefill_first_tokens(runner: ModelRunner, seqs: list[Sequence]) -> torch.Tensor:
    """Prefill `seqs` (their block tables set), append each one's first token; the prefill's
    logits on the host."""
    logits = runner.prefill([s.prompt_token_ids for s in seqs], [s.block_table for s in seqs],
                            [0] * len(seqs))  # fmt: skip
    for s, t in zip(seqs, runner.sample(logits, [s.sampling for s in seqs]).result().token_ids,
                    strict=True):  # fmt: skip
        s.append(t)
    return logits.float().cpu()


def greedy_tokens(runner: ModelRunner, batch: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each sequence's greedy tokens (`started`'s), and each decode step's logits [batch,
    vocab] on the host. A decode step is `runner.decode`'s two calls, with its logits copied
    out in between."""
    seqs, prefill_logits = started(runner, batch)
    step_logits = [prefill_logits]
    while active := [s for s in seqs if not s.is_finished]:
        assert len(active) == batch  # so row i of every step's logits is sequence i
        with torch.inference_mode():
            logits = runner.decode_logits(active)
            step_logits.append(logits.float().cpu())  # before a later replay overwrites it
            sampled = runner.sample(logits, [s.sampling for s in active]).result().token_ids
        for s, t in zip(active, sampled, strict=True):
            s.append(t)
    return [s.output_token_ids for s in seqs], step_logits


@pytest.mark.parametrize("batch", [1, 3, 17, 64])
def test_graph_replay_gives_the_eager_greedy_tokens(
    cuda_model: Qwen3ForCausalLM, batch: int
) -> None:
    num_blocks = 64 * blocks_needed(40 + MAX_TOKENS, BLOCK_SIZE)
    eager = ModelRunner.create(cuda_model, num_blocks, BLOCK_SIZE, max_decode_batch=64)
    graphs = ModelRunner.create(cuda_model, num_blocks, BLOCK_SIZE, max_decode_batch=64)
    graphs.capture_graphs()
    assert graphs.graphs is not None and graphs.graphs.batch_sizes[-1] == 64
    graph_tokens, _ = greedy_tokens(graphs, batch)
    eager_tokens, eager_logits = greedy_tokens(eager, batch)
    assert graph_tokens == eager_tokens, describe_divergence(
        eager_tokens, graph_tokens, eager_logits, names=("eager", "graph")
    )


@pytest.mark.parametrize("use_graphs", [False, True])
def test_no_host_sync_inside_a_decode_step(cuda_model: Qwen3ForCausalLM, use_graphs: bool) -> None:
    runner = ModelRunner.create(cuda_model, 64, BLOCK_SIZE, max_decode_batch=8)
    if use_graphs:
        assert runner.capture_graphs(), "the capture failed (see the warning)"
    vocab_size = cuda_model.config.vocab_size
    pool = BlockPool(runner.num_blocks, null_block=True)
    params = [
        SamplingParams(min_tokens=5, stop_token_ids=(3,)),  # its stop id held back
        SamplingParams(
            temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=3, logit_bias=((4, 1.5),)
        ),
        SamplingParams(temperature=1.0, repetition_penalty=1.2, presence_penalty=0.3, logprobs=2),
    ]
    seqs = []
    for i, sp in enumerate(params):
        s = Sequence.new([5 + i, 6, 7], sp, vocab_size=vocab_size, eos_token_ids=[])
        s.block_table = pool.allocate(2)
        seqs.append(s)
    logits = runner.prefill([s.prompt_token_ids for s in seqs], [s.block_table for s in seqs],
                            [0, 0, 0])  # fmt: skip
    for s, t in zip(seqs, runner.sample(logits, [s.sampling for s in seqs]).result().token_ids,
                    strict=True):  # fmt: skip
        s.append(t)
    runner.decode(seqs).result()  # first step: lazy initialisation may sync
    for s in seqs:
        s.append(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = runner.decode(seqs)  # launches everything; raises on any synchronizing call
        # the next step's forward, launched before `pending`'s ids are in (decode's overlap)
        with torch.inference_mode():
            logits = runner.decode_logits(seqs, ahead=Launched(seqs, pending))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for s, t in zip(seqs, pending.result().token_ids, strict=True):  # the one wait
        s.append(t)
    # Rows 0 and 2 constrained (as decode's masker hands them over: int32 words in pinned
    # memory), allowing the ids below 64: the mask's row ids take the gather path (not all rows).
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros((2, words), dtype=torch.int32, pin_memory=True)
    bitmask[:, :2] = -1
    mask = FilledMask(bitmask, [0, 2])
    torch.cuda.set_sync_debug_mode("error")
    try:  # its sampling (penalties, logprobs, masks, min_tokens, logit_bias) after the append
        ahead = runner.sample(logits, [s.sampling for s in seqs], mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens = ahead.result().token_ids
    assert len(tokens) == 3
    assert tokens[0] < 64 and tokens[2] < 64, tokens


@pytest.mark.parametrize("batch", [1, 17])
def test_graph_steps_launched_ahead_give_the_eager_greedy_tokens(
    cuda_model: Qwen3ForCausalLM, batch: int
) -> None:
    """Decode's overlapped steps on the device: each step's input ids gathered from the last
    step's sampled ids inside the stream, graphs replayed on them."""
    num_blocks = 64 * blocks_needed(40 + MAX_TOKENS, BLOCK_SIZE)
    eager = ModelRunner.create(cuda_model, num_blocks, BLOCK_SIZE, max_decode_batch=64)
    graphs = ModelRunner.create(cuda_model, num_blocks, BLOCK_SIZE, max_decode_batch=64)
    assert graphs.capture_graphs(), "the capture failed (see the warning)"
    assert check_ahead(graphs) is None  # decode's start-up check, on the graphs
    eager_tokens, eager_logits = greedy_tokens(eager, batch)
    seqs, _ = started(graphs, batch)
    assert run_ahead(graphs, seqs) == MAX_TOKENS - 2  # every step but the first went ahead
    ahead_tokens = [s.output_token_ids for s in seqs]
    assert ahead_tokens == eager_tokens, describe_divergence(
        eager_tokens, ahead_tokens, eager_logits, names=("eager", "graph ahead")
    )


@pytest.mark.parametrize("batch", [1, 17])
def test_sampled_graph_steps_draw_what_eager_sampling_draws(
    cuda_model: Qwen3ForCausalLM, batch: int
) -> None:
    """Seeded temperature-1 and Qwen3-style rows, decoded with graphs: the sampling's graphs
    (sampler_graphs.py, replayed from the third step of a batch size on) draw the tokens the
    eager sampler draws on the same runner."""
    num_blocks = 64 * blocks_needed(40 + MAX_TOKENS, BLOCK_SIZE)
    runner = ModelRunner.create(cuda_model, num_blocks, BLOCK_SIZE, max_decode_batch=64)
    assert runner.capture_graphs(), "the capture failed (see the warning)"
    assert runner.sampler_graphs is not None
    # greedy and temperature alone, captured at every size at start-up (`prepare`)
    assert runner.sampler_graphs.num_graphs == 2 * len(runner.batch_sizes)
    vocab_size = cuda_model.config.vocab_size
    params = [
        SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=8, max_tokens=MAX_TOKENS),
    ]
    sampler_graphs = runner.sampler_graphs
    outputs = []
    for graphs in (sampler_graphs, None):
        runner.sampler_graphs = graphs
        pool = BlockPool(runner.num_blocks, null_block=True)
        seqs = []
        for i in range(batch):
            s = Sequence.new([5 + i, 6, 7], params[i % 2], vocab_size=vocab_size, eos_token_ids=[])
            s.block_table = pool.allocate(blocks_needed(3 + MAX_TOKENS, BLOCK_SIZE))
            seqs.append(s)
        prefill_first_tokens(runner, seqs)
        while active := [s for s in seqs if not s.is_finished]:
            for s, t in zip(active, runner.decode(active).result().token_ids, strict=True):
                s.append(t)
        outputs.append([s.output_token_ids for s in seqs])
    assert outputs[0] == outputs[1]
    assert sampler_graphs.num_replays >= MAX_TOKENS - 3  # steps 3 on of the decode loop


def recomputed_midway(runner: ModelRunner, batch: int, at_step: int) -> list[list[int]]:
    """`greedy_tokens`' run, but before decode step `at_step` sequence 0 is preempted and
    resumed as decode's batch thread does it: a new block_table list of other blocks
    (RequestTable.resume), its K/V computed again by an eager prefill over what it wrote."""
    seqs, _ = started(runner, batch)
    num_used = sum(len(s.block_table) for s in seqs)
    step = 0
    while active := [s for s in seqs if not s.is_finished]:
        if step == at_step:
            first = seqs[0]
            written = first.written_token_ids()
            first.block_table = list(range(num_used, num_used + len(first.block_table)))
            with torch.inference_mode():
                runner.prefill([written], [first.block_table], [0])
        with torch.inference_mode():
            logits = runner.decode_logits(active)
            sampled = runner.sample(logits, [s.sampling for s in active]).result().token_ids
        for s, t in zip(active, sampled, strict=True):
            s.append(t)
        step += 1
    return [s.output_token_ids for s in seqs]


def test_graph_steps_after_a_sequences_kv_is_computed_again_give_the_same_tokens(
    cuda_model: Qwen3ForCausalLM,
) -> None:
    """Decode's preemption on the device: a sequence resumed on new blocks (the graphs' block
    table row copied again, as its list is new) with its K/V from an eager prefill goes on to
    the tokens of the run never stopped."""
    num_blocks = 64 * blocks_needed(40 + MAX_TOKENS, BLOCK_SIZE)
    eager = ModelRunner.create(cuda_model, num_blocks, BLOCK_SIZE, max_decode_batch=64)
    graphs = ModelRunner.create(cuda_model, num_blocks, BLOCK_SIZE, max_decode_batch=64)
    assert graphs.capture_graphs(), "the capture failed (see the warning)"
    eager_tokens, eager_logits = greedy_tokens(eager, 17)  # one capture: the piece's time
    resumed_tokens = recomputed_midway(graphs, 17, at_step=3)
    assert resumed_tokens == eager_tokens, describe_divergence(
        eager_tokens, resumed_tokens, eager_logits, names=("eager", "graph, resumed")
    )
