"""Prompt logprobs (ModelRunner.prefill_step) vs HF transformers on the same checkpoint: every
prompt position's log p(prompt[i] | prompt[:i]) and top-n, across chunks and logits passes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mili.engine.kv.block_pool import blocks_needed
from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.step import prompt_logprobs as prompt_logprobs_module
from mili.engine.step.distribution import ranked_raw_logprobs
from mili.engine.step.prompt_logprobs import PromptLogprobsAsk, chunk_targets
from mili.engine.step.runner import ModelRunner

TOL = 1e-4  # float32, as the generated tokens' logprob test
BLOCK_SIZE = 4


def random_ids(n: int, vocab_size: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n,), generator=g).tolist()


def hf_logprobs(hf: Any, prompt: list[int], vocab_size: int) -> torch.Tensor:
    """[len(prompt) - 1, vocab_size]: row i - 1 is the distribution of prompt token i, HF's
    log_softmax over all the model's rows read at the tokenizer's ids."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(-1)[:, :vocab_size]


def hf_rank_bounds(row: torch.Tensor, token: int) -> tuple[int, int]:
    """The ranks (vLLM's: entries >= the token's logprob, itself included) `token` may have in
    HF's `row` given TOL of float32 rounding between the two: ties within TOL either way."""
    value = row[token].item()
    return int((row > value + TOL).sum()) + 1, int((row >= value - TOL).sum())


def test_ranks_count_every_entry_at_least_as_likely_ties_included() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0], [5.0, 1.0, 1.0, 0.5]])
    chosen, top_values, top_ids, ranks = ranked_raw_logprobs(logits, torch.tensor([2, 0, 0]), 2, 4)
    # row 0: token 2 is below the two tied 3.0s: rank 3; row 1: all tie: 4; row 2: the top: 1
    assert ranks.tolist() == [3, 4, 1]
    assert chosen.tolist() == pytest.approx(logits.log_softmax(-1)[[0, 1, 2], [2, 0, 0]].tolist())
    assert top_ids[2].tolist()[0] == 0 and top_values.shape == (3, 2)


def test_a_padding_row_counts_in_the_normalizer_but_is_never_named() -> None:
    """Columns past the tokenizer's ids (an embedding table's padding) take their share of the
    row's probability, as in HF's log_softmax, but are never listed nor counted in a rank."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 5.0]])  # column 3: padding, the most likely
    chosen, top_values, top_ids, ranks = ranked_raw_logprobs(logits, torch.tensor([1]), 3, 3)
    expected = logits.log_softmax(-1)[0]
    assert chosen.tolist() == pytest.approx([expected[1].item()])
    assert top_ids.tolist() == [[1, 2, 0]] and ranks.tolist() == [1]
    assert top_values[0].tolist() == pytest.approx(expected[[1, 2, 0]].tolist())


def test_chunk_targets_cover_every_position_after_the_first_once() -> None:
    prompt = list(range(10, 17))  # N = 7
    bounds = [(0, 4), (4, 7)]
    parts = [list(chunk_targets(prompt, s, e)) for s, e in bounds]
    assert parts == [[11, 12, 13, 14], [15, 16]]
    assert list(chunk_targets([5], 0, 1)) == []


@pytest.mark.parametrize("vocab_size", [None, 200])  # 200: a tokenizer smaller than the rows
def test_prompt_logprobs_match_hf_across_chunks_and_passes(
    vocab_size: int | None,
    engine_models: dict[str, Qwen3ForCausalLM],
    hf_models: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prompt_logprobs_module, "ROWS_PER_PASS", 3)  # several passes per chunk
    name = "untied_gqa4"
    model = engine_models[name]
    runner = ModelRunner.create(model, 32, BLOCK_SIZE, vocab_size=vocab_size)
    vocab = runner.vocab_size
    prompt = random_ids(19, vocab, seed=30)
    other = random_ids(6, vocab, seed=31)  # asks for nothing: its last logits as before
    ref = hf_logprobs(hf_models[name], prompt, vocab)
    table = list(range(blocks_needed(len(prompt), BLOCK_SIZE)))
    other_table = list(range(len(table), len(table) + blocks_needed(len(other), BLOCK_SIZE)))

    got = []
    for start, end in [(0, 8), (8, 16), (16, 19)]:  # chunked prefill, `other` in the first step
        chunks, tables, starts = [prompt[start:end]], [table], [start]
        if start == 0:
            chunks, tables, starts = [other, *chunks], [other_table, *tables], [0, *starts]
        row = len(chunks) - 1
        ask = PromptLogprobsAsk(row, chunk_targets(prompt, start, end), 5)
        out = runner.prefill_step(chunks, tables, starts, prompt_logprobs=[ask])
        got.extend(out.prompt_logprobs[0].result())
        if start == 0:
            alone = runner.prefill([other], [other_table], [0])
            torch.testing.assert_close(out.logits[0], alone[0], rtol=0, atol=1e-5)

    assert len(got) == len(prompt) - 1
    for i, lp in enumerate(got):
        token = prompt[i + 1]
        assert lp.logprob == pytest.approx(ref[i, token].item(), abs=TOL), i
        values, ids = ref[i].topk(5)
        assert [t for t, _ in lp.top] == ids.tolist(), i
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=TOL)
        assert all(t < vocab for t, _ in lp.top)
        low, high = hf_rank_bounds(ref[i], token)
        assert low <= lp.rank <= high, (i, lp.rank, low, high)


def test_a_one_token_prompt_and_top_zero_give_what_they_ask(
    engine_models: dict[str, Qwen3ForCausalLM], hf_models: dict[str, Any]
) -> None:
    model = engine_models["tied_gqa2"]
    runner = ModelRunner.create(model, 8, BLOCK_SIZE)
    prompt = random_ids(5, runner.vocab_size, seed=32)
    asks = [
        PromptLogprobsAsk(0, [], 3),
        PromptLogprobsAsk(1, [], 0),  # echo with logprobs 0 of a one-token prompt (HTTP)
        PromptLogprobsAsk(2, chunk_targets(prompt, 0, 5), 0),
    ]
    out = runner.prefill_step(
        [[7], [9], prompt], [[0], [3], [1, 2]], [0, 0, 0], prompt_logprobs=asks
    )
    assert out.prompt_logprobs[0].result() == out.prompt_logprobs[1].result() == []
    got = out.prompt_logprobs[2].result()
    ref = hf_logprobs(hf_models["tied_gqa2"], prompt, runner.vocab_size)
    assert [lp.top for lp in got] == [[]] * 4
    assert [lp.logprob for lp in got] == pytest.approx(
        [ref[i, t].item() for i, t in enumerate(prompt[1:])], abs=TOL
    )
    for i, (lp, token) in enumerate(zip(got, prompt[1:], strict=True)):  # top 0: ranks still
        low, high = hf_rank_bounds(ref[i], token)
        assert low <= lp.rank <= high
