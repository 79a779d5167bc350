"""ModelRunner.decode with `ahead`: a step launched before the previous step's ids reach the
host (decode's overlapped steps) samples exactly what waiting for them samples, on the CPU
(the same code runs on CUDA: tests/engine/test_runner_gpu.py)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import pytest
import torch

from mili.engine.kv.block_pool import BlockPool
from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.ahead_check import check_ahead
from mili.engine.step.runner import Launched, ModelRunner
from mili.engine.step.sampler import SamplerOutput
from mili.engine.step.sequence import Sequence
from tests.engine.test_runner import BLOCK_SIZE, prompts, run_to_end, start


def run_ahead(runner: ModelRunner, seqs: list[Sequence]) -> int:
    """`run_to_end`, as the decode batcher overlaps steps: each step's forward launched
    before the previous step's ids are appended, its sampling after. A sequence the pending
    token ends by length sits the next step out; one it stops runs it and that token is
    dropped. Returns the forwards launched ahead of a pending step."""
    pending: Launched | None = None
    num_ahead = 0
    while True:
        in_flight = set() if pending is None else {id(s) for s in pending.seqs}
        batch = [
            s
            for s in seqs
            if not s.is_finished and not (id(s) in in_flight and s.is_length_bound())
        ]
        logits = None
        if batch:
            with torch.inference_mode():
                logits = runner.decode_logits(batch, ahead=pending)
            num_ahead += pending is not None
        if pending is not None:
            collect(pending.seqs, pending.sample.result())
        if logits is None:
            if pending is None:
                return num_ahead
            pending = None
            continue
        pending = Launched(batch, runner.sample(logits, [s.sampling for s in batch]))


def collect(seqs: Seq[Sequence], out: SamplerOutput) -> None:
    for s, token_id in zip(seqs, out.token_ids, strict=True):
        if not s.is_finished:  # else: stopped by the step before; this token is dropped
            s.append(token_id)


def test_steps_launched_ahead_sample_what_waiting_samples(
    engine_models: dict[str, Qwen3ForCausalLM],
) -> None:
    model = engine_models["tied_gqa2"]
    vocab_size = model.config.vocab_size
    prompt_ids = prompts(8, vocab_size, seed=5)
    params = [
        SamplingParams(temperature=0.0, max_tokens=14),
        SamplingParams(temperature=1.5, top_p=0.95, max_tokens=11, seed=4321),
        SamplingParams(temperature=1.0, top_k=7, max_tokens=3, seed=1, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=1),  # prefill's token ends it
        SamplingParams(temperature=0.8, min_p=0.05, max_tokens=9, seed=9),
        SamplingParams(temperature=0.0, max_tokens=2),
        SamplingParams(temperature=1.2, repetition_penalty=1.3, max_tokens=10, seed=5),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.2, max_tokens=12, seed=6),
    ]

    def tokens(ahead: bool, stop_ids: list[int] | None = None) -> tuple[list[list[int]], int]:
        runner = ModelRunner.create(model, 64, BLOCK_SIZE, max_decode_batch=8)
        pool = BlockPool(runner.num_blocks, null_block=True)
        seqs = start(runner, pool, prompt_ids, params)
        if stop_ids is not None:
            for s, stop_id in zip(seqs, stop_ids, strict=True):
                s.stop_token_ids = frozenset([stop_id])
        if ahead:
            num_ahead = run_ahead(runner, seqs)
        else:
            run_to_end(runner, seqs)
            num_ahead = 0
        return [s.output_token_ids for s in seqs], num_ahead

    waited, _ = tokens(ahead=False)
    assert [len(t) for t in waited] == [p.max_tokens for p in params]
    overlapped, num_ahead = tokens(ahead=True)
    assert overlapped == waited
    assert num_ahead >= 10  # the longest runs 13 steps; all but the first go ahead

    # Stop ids met mid-generation (each sequence's 4th token): the step already launched
    # for it is dropped, and the outputs still match.
    stop_ids = [t[3] if len(t) > 4 else vocab_size - 1 for t in waited]
    waited, _ = tokens(ahead=False, stop_ids=stop_ids)
    assert len(waited[0]) <= 4 and len(waited[1]) <= 4
    overlapped, _ = tokens(ahead=True, stop_ids=stop_ids)
    assert overlapped == waited


def test_an_ahead_step_padded_to_a_graph_size_gives_the_waited_logits(
    engine_models: dict[str, Qwen3ForCausalLM],
) -> None:
    """The CUDA-graph shape (padded rows, full-width tables), eagerly: the input ids gathered
    on the device equal the ones the host would have written."""
    model = engine_models["untied_gqa4"]
    runner = ModelRunner.create(model, 40, BLOCK_SIZE, max_decode_batch=8)
    pool = BlockPool(runner.num_blocks, null_block=True)
    seqs = start(
        runner, pool, prompts(3, model.config.vocab_size), [SamplingParams(max_tokens=6)] * 3
    )
    first = Launched(seqs, runner.decode(seqs))
    # Rows in another order, and one not ahead (as a newcomer: it feeds the token the host
    # has, again): `first` seen with another sequence in seqs[1]'s row.
    other = Sequence.new([5, 6], SamplingParams(), vocab_size=runner.vocab_size, eos_token_ids=[])
    later = [seqs[2], seqs[1], seqs[0]]
    with torch.inference_mode():
        ahead = runner.decode_logits(
            later, num_rows=8, ahead=Launched([seqs[0], other, seqs[2]], first.sample)
        ).clone()  # [3, vocab]
    out = first.sample.result()
    seqs[0].append(out.token_ids[0])
    seqs[2].append(out.token_ids[2])
    with torch.inference_mode():
        waited = runner.decode_logits(later).clone()
    torch.testing.assert_close(ahead, waited, rtol=0, atol=1e-5)


def test_a_row_its_pending_token_ends_by_length_is_refused(
    engine_models: dict[str, Qwen3ForCausalLM],
) -> None:
    """Its reservation ends at that token: the forward would write past it."""
    model = engine_models["tied_gqa2"]
    runner = ModelRunner.create(model, 40, BLOCK_SIZE, max_decode_batch=8)
    pool = BlockPool(runner.num_blocks, null_block=True)
    (s,) = start(runner, pool, prompts(1, model.config.vocab_size), [SamplingParams(max_tokens=2)])
    pending = Launched([s], runner.decode([s]))
    with pytest.raises(ValueError, match="ends cannot run"):
        runner.decode_logits([s], ahead=pending)
    assert len(pending.sample.result().token_ids) == 1


def test_the_start_up_check_passes_and_touches_only_the_null_block(
    engine_models: dict[str, Qwen3ForCausalLM],
) -> None:
    model = engine_models["untied_gqa4"]
    runner = ModelRunner.create(model, 12, BLOCK_SIZE, max_decode_batch=4)
    pool = BlockPool(runner.num_blocks, null_block=True)
    start(runner, pool, prompts(2, model.config.vocab_size), [SamplingParams(max_tokens=4)] * 2)
    null = runner.null_block_id
    before = [k[:null].clone() for k in runner.kv_cache.k]
    assert check_ahead(runner) is None
    assert all(torch.equal(b, k[:null]) for b, k in zip(before, runner.kv_cache.k, strict=True))


def test_the_start_up_check_catches_a_forward_not_fed_from_the_device(
    engine_models: dict[str, Qwen3ForCausalLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gather that does nothing (the rows keep the host's stale id and position)."""
    runner = ModelRunner.create(engine_models["untied_gqa4"], 12, BLOCK_SIZE, max_decode_batch=4)
    fill = runner.inputs.fill

    def stale(seqs: Any, num_rows: int, sources: Any = None, sampled: Any = None) -> int:
        return fill(seqs, num_rows)

    monkeypatch.setattr(runner.inputs, "fill", stale)
    why = check_ahead(runner)
    assert why is not None and "differ" in why, why
