from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mili.engine.sampling_params import GREEDY_TEMPERATURE
from mili.engine.step.distribution import (
    apply_penalties,
    filter_logits,
    inverse_cdf_in_blocks,
    inverse_cdf_whole_rows,
    sample_inverse_cdf,
)
from mili.engine.step.sampler import Sampler, SamplingParams, SequenceSampling, _filter_head
from mili.errors import InvalidArgument
from mili.rpc.sampling import sampling_params_to_proto

PROBS = [0.5, 0.2, 0.15, 0.1, 0.05]
TIED = [0.4, 0.2, 0.2, 0.1, 0.1]


def sorted_rows(probs: list[float], num_rows: int) -> torch.Tensor:
    """[num_rows, V] copies of log(probs) (already sorted descending)."""
    return torch.tensor(probs).log().expand(num_rows, -1)


def kept(remove: torch.Tensor) -> list[set[int]]:
    """Per row, the token positions a [B, V] removal mask keeps."""
    return [set((~row).nonzero().flatten().tolist()) for row in remove]


def column(values: list[float] | list[int]) -> torch.Tensor:
    return torch.tensor(values).unsqueeze(-1)


def run(sampler: Sampler, logits: torch.Tensor, seqs: list[SequenceSampling]) -> list[int]:
    """One step: sample, then record each token as the engine does."""
    token_ids = sampler(logits, seqs).token_ids
    for seq, token_id in zip(seqs, token_ids, strict=True):
        seq.append(token_id)
    return token_ids


# -- masks ----------------------------------------------------------------------------------------


def filtered(
    logits: torch.Tensor,
    *,
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    min_p: list[float] | None = None,
    head_size: int | None = None,
) -> list[set[int]]:
    """Per row, the token positions filter_logits keeps; a filter not given is off."""
    rows, vocab = logits.shape
    out = filter_logits(
        logits,
        column(top_k or [vocab] * rows).long(),
        column(top_p or [1.0] * rows),
        column(min_p or [0.0] * rows),
        head_size,
    )
    return kept(out.isinf())


@pytest.mark.parametrize("head_size", [None, 5])  # a sort of whole rows, or topk's head
def test_top_k_exact_sets(head_size: int | None) -> None:
    ks = [1, 2, 3, 5]
    assert filtered(sorted_rows(PROBS, 4), top_k=ks, head_size=head_size) == [
        {0},
        {0, 1},
        {0, 1, 2},
        {0, 1, 2, 3, 4},
    ]
    # Ties with the k-th token are kept.
    ks = [1, 2, 4]
    assert filtered(sorted_rows(TIED, 3), top_k=ks, head_size=head_size) == [
        {0},
        {0, 1, 2},
        {0, 1, 2, 3, 4},
    ]


def test_top_p_exact_sets() -> None:
    ps = [0.3, 0.6, 0.75, 0.9, 0.97, 1.0]
    assert filtered(sorted_rows(PROBS, 6), top_p=ps) == [
        {0},
        {0, 1},
        {0, 1, 2},
        {0, 1, 2, 3},
        {0, 1, 2, 3, 4},
        {0, 1, 2, 3, 4},
    ]
    # Ties with the last token of the nucleus are kept: 0.4 + 0.2 = 0.6 >= 0.5 would stop at
    # token 1, but token 2 has the same probability.
    ps = [0.5, 0.85]
    assert filtered(sorted_rows(TIED, 2), top_p=ps) == [{0, 1, 2}, {0, 1, 2, 3, 4}]


def test_top_p_one_keeps_a_tail_that_float_cumsum_rounds_away() -> None:
    # cumsum reaches 1.0 in float32 long before these 1e-12 tokens.
    probs = torch.tensor([[0.999999] + [1e-12] * 100])
    assert filtered(probs.log(), top_p=[1.0]) == [set(range(101))]


@pytest.mark.parametrize("head_size", [None, 1])
def test_min_p_exact_sets(head_size: int | None) -> None:
    ms = [0.0, 0.15, 0.25, 0.35, 0.5, 1.0]
    assert filtered(sorted_rows(PROBS, 6), min_p=ms, head_size=head_size) == [
        {0, 1, 2, 3, 4},
        {0, 1, 2, 3},  # threshold 0.075
        {0, 1, 2},  # 0.125
        {0, 1},  # 0.175
        {0},  # 0.25
        {0},
    ]
    ties = torch.tensor([[0.3, 0.3, 0.2, 0.1, 0.1]]).log()
    assert filtered(ties, min_p=[1.0], head_size=head_size) == [{0, 1}]


def test_filters_read_off_the_topk_head_keep_what_a_sort_of_the_rows_keeps() -> None:
    """bf16 logits (many ties, some with the k-th), rows a constraint masked down to fewer
    tokens than their top-k, every filter on: the head of the largest top-k decides the same."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(256, 3000, generator=g) * 2).bfloat16().float()
    logits[:32, 40:] = float("-inf")  # 40 tokens allowed: fewer than some rows' top-k
    logits[32:64] = logits[32:64].round()  # many ties with the k-th
    top_k = torch.randint(1, 61, (256, 1), generator=g)
    top_p = torch.rand(256, 1, generator=g) * 0.8 + 0.2
    top_p[::7] = 1.0
    min_p = torch.rand(256, 1, generator=g) * 0.2
    min_p[::3] = 0.0
    whole = filter_logits(logits, top_k, top_p, min_p)
    head = filter_logits(logits, top_k, top_p, min_p, head_size=60)
    assert torch.equal(head.isinf(), whole.isinf())
    kept_counts = (~whole.isinf()).sum(-1)
    assert kept_counts.min() >= 1 and kept_counts.max() > 1  # the filters did work
    assert bool((kept_counts[32:64] > top_k[32:64, 0]).any())  # ties past the k-th kept


def test_filter_head_is_used_only_where_every_nucleus_lies_in_a_top_k() -> None:
    v = 1000
    top_k_20 = SamplingParams(top_k=20, top_p=0.95)
    assert _filter_head([top_k_20, SamplingParams(top_k=50), SamplingParams(min_p=0.1)], v) == 50
    assert _filter_head([SamplingParams(min_p=0.1)], v) == 1
    assert _filter_head([top_k_20, SamplingParams(top_p=0.9)], v) is None  # top-p, no top-k
    assert _filter_head([top_k_20, SamplingParams(temperature=0, top_p=0.9)], v) == 20  # greedy
    assert _filter_head([SamplingParams(top_k=2000)], 5000) is None  # too large a head
    assert _filter_head([SamplingParams(top_k=2000, top_p=0.5)], 1500) is None  # k = V: off


def test_filter_logits_works_in_vocab_order_and_renormalizes_for_top_p() -> None:
    perm = torch.tensor([3, 0, 4, 1, 2])  # vocab id perm[j] holds PROBS[j]
    logits = torch.empty(4, 5)
    logits[:, perm] = torch.tensor(PROBS).log()
    out = filter_logits(
        logits,
        top_k=column([5, 2, 5, 5]),
        top_p=column([0.65, 0.65, 1.0, 0.75]),
        min_p=column([0.0, 0.0, 0.25, 0.3]),
    )
    # Row 0: top-p 0.65 keeps PROBS[0:2]. Row 1: top-2 leaves [0.71, 0.29] renormalized, so
    # top-p 0.65 keeps only the first. Row 2: min-p 0.25 keeps prob >= 0.125. Row 3 (vLLM's
    # order): min-p 0.3 keeps [0.5, 0.2, 0.15], renormalized [0.59, 0.24, 0.18], whose nucleus
    # of 0.75 is the first two (top-p over the unfiltered row would keep three).
    assert kept(out.isinf()) == [{3, 0}, {3}, {3, 0, 4}, {3, 0}]
    assert torch.equal(out[~out.isinf()], logits[~out.isinf()])  # kept logits unchanged


# -- penalties ------------------------------------------------------------------------------------


def test_penalties_match_hand_computed_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0]])
    prompt_mask = torch.tensor([[True, True, False, False, False]])
    counts = torch.tensor([[0.0, 0.0, 2.0, 1.0, 0.0]])

    def penalize(rep: float, pres: float, freq: float) -> list[float]:
        out = apply_penalties(logits, prompt_mask, counts, *map(column, ([rep], [pres], [freq])))
        return out[0].tolist()

    # Repetition (prompt and output tokens): positive / 2, negative * 2; token 4 unseen.
    assert penalize(2.0, 0.0, 0.0) == [1.0, -2.0, 0.25, -1.0, 1.0]
    # Presence: generated tokens 2 and 3 only, once each.
    assert penalize(1.0, 0.25, 0.0) == [2.0, -1.0, 0.25, -0.75, 1.0]
    # Frequency: times the count (2 and 1).
    assert penalize(1.0, 0.0, 0.5) == [2.0, -1.0, -0.5, -1.0, 1.0]
    # All three: 0.25 - 0.5*2 - 0.25 = -1.0 ; -1.0 - 0.5*1 - 0.25 = -1.75
    assert penalize(2.0, 0.25, 0.5) == [1.0, -2.0, -1.0, -1.75, 1.0]
    # Defaults leave the row bit-for-bit unchanged.
    assert penalize(1.0, 0.0, 0.0) == logits[0].tolist()


def test_a_tiny_repetition_penalty_makes_the_seen_tokens_likely_not_a_nan_row() -> None:
    """Any penalty > 0 is valid; 1e-40 divided the seen positive logits past float32 (+inf, a
    NaN softmax): every draw took the last column, an unseen token, whatever the seed."""
    logits = torch.tensor([[3.0, -1.0, 2.0, 0.5, 1.0]]).repeat(16, 1)
    prompt = [0, 2]
    for penalty in (1e-40, 1e-45):
        hot = [
            SequenceSampling(SamplingParams(repetition_penalty=penalty, seed=s), prompt, 5)
            for s in range(16)
        ]
        drawn = Sampler()(logits, hot).token_ids
        assert set(drawn) <= {0, 2} and len(set(drawn)) == 2  # the seen, boosted tokens
        greedy = SequenceSampling(
            SamplingParams(temperature=0, repetition_penalty=penalty), prompt, 5
        )
        assert Sampler()(logits[:1], [greedy]).token_ids[0] in (0, 2)
        low = SamplingParams(temperature=GREEDY_TEMPERATURE, repetition_penalty=penalty, seed=1)
        assert Sampler()(logits[:1], [SequenceSampling(low, prompt, 5)]).token_ids[0] in (0, 2)


def test_sampler_builds_penalty_state_from_prompt_and_outputs() -> None:
    sampler = Sampler()
    logits = torch.tensor([[3.0, 2.9, 2.05, -1.0]]).repeat(3, 1)
    greedy_rep = SamplingParams(temperature=0, repetition_penalty=1.5)
    seqs = [
        SequenceSampling(greedy_rep, prompt_token_ids=[0, 0, 3], vocab_size=4),  # 3.0 -> 2.0
        SequenceSampling(SamplingParams(temperature=0, frequency_penalty=0.6), [0], 4, [0, 1, 0]),
        SequenceSampling(SamplingParams(temperature=0), [0], 4),  # no penalties: plain argmax
    ]
    # Row 1: 3.0 - 1.2 = 1.8, 2.9 - 0.6 = 2.3, 2.05 untouched -> token 1.
    assert sampler(logits, seqs).token_ids == [1, 1, 0]
    seqs[0].append(1)  # 2.9 / 1.5 = 1.93; 2.05 wins -> token 2
    assert sampler(logits, seqs).token_ids[0] == 2
    # The caller's tensor is not modified.
    assert torch.equal(logits, torch.tensor([[3.0, 2.9, 2.05, -1.0]]).repeat(3, 1))


def test_min_tokens_holds_back_the_stop_ids_until_reached() -> None:
    """A row with min_tokens never draws a stop id (its own, or Sequence's EOS) before its
    min_tokens-th token; greedy and random rows alike; logprobs stay the raw ones."""
    logits = torch.tensor([[1.0, 9.0, 8.0, 0.0, 7.5]])  # id 1 the argmax, id 2 next
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(1,), logprobs=1)
    row = SequenceSampling(params, [0], 5, stop_token_ids={1, 2})  # 2: the model's EOS, say
    sampler = Sampler()
    first = sampler(logits, [row])
    assert first.token_ids == [4]  # 1 and 2 held back: the best of the rest
    assert first.logprobs is not None and first.top_logprobs is not None
    assert first.top_logprobs[0][0][0] == 1  # the raw distribution's most likely, reported
    assert torch.equal(logits, torch.tensor([[1.0, 9.0, 8.0, 0.0, 7.5]]))  # not written
    row.append(4)
    assert sampler(logits, [row]).token_ids == [4]  # one token so far: still held back
    row.append(4)
    assert sampler(logits, [row]).token_ids == [1]  # min_tokens reached: the stop id is free
    # Random rows: the stop ids hold almost all the mass, yet are never drawn before the min.
    hot = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=(1, 2), seed=7)
    peaked = torch.tensor([[0.0, 30.0, 30.0, 0.0, 0.0]]).repeat(16, 1)
    rows = [SequenceSampling(hot, [], 5) for _ in range(16)]  # default: the request's stop ids
    assert all(t not in (1, 2) for t in sampler(peaked, rows).token_ids)
    # Without min_tokens nothing is held back.
    plain = SequenceSampling(SamplingParams(temperature=0, stop_token_ids=(1,)), [0], 5)
    assert plain.held_ids.size == 0 and sampler(logits, [plain]).token_ids == [1]


def test_logit_bias_is_added_before_the_draw_and_not_to_logprobs() -> None:
    logits = torch.tensor([[1.0, 9.0, 8.0, 0.0, 7.5]]).repeat(3, 1)
    rows = [
        SequenceSampling(SamplingParams(temperature=0, logit_bias=((3, 100.0),)), [], 5),
        SequenceSampling(SamplingParams(temperature=0, logit_bias=((1, -100.0), (2, -1.0))), [], 5),
        SequenceSampling(SamplingParams(temperature=0, logprobs=0), [], 5),  # unbiased
    ]
    out = Sampler()(logits, rows)
    assert out.token_ids == [3, 4, 1]  # 0 + 100; 9 - 100 and 8 - 1 lose to 7.5; argmax
    assert out.logprobs is not None
    raw = torch.log_softmax(logits[2], -1)[1].item()
    assert out.logprobs[2] == pytest.approx(raw)  # the unbiased row's raw logprob
    assert torch.equal(logits, torch.tensor([[1.0, 9.0, 8.0, 0.0, 7.5]]).repeat(3, 1))
    # Random rows: -100 in effect bans a token that holds almost all the mass.
    banned = SamplingParams(temperature=1.0, seed=3, logit_bias=((1, -100.0),))
    peaked = torch.tensor([[0.0, 40.0, 0.0, 0.0, 0.0]]).repeat(16, 1)
    assert (
        1 not in Sampler()(peaked, [SequenceSampling(banned, [], 5) for _ in range(16)]).token_ids
    )
    # An id past the tokenizer's vocabulary (a padded embedding's rows) is left alone.
    assert SequenceSampling(SamplingParams(logit_bias=((7, 1.0),)), [], 5).bias_ids.size == 0


def test_penalties_count_every_output_token_past_the_arrays_growth() -> None:
    """A row's output ids for penalties live in an array grown by doubling: 40 appends (past
    16 and 32) count each id as often as it was generated; frequency_penalty 1 takes off
    exactly that count."""
    vocab_size = 8
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    row = SequenceSampling(params, [7, 7, 7], vocab_size)
    generated = [i % 5 for i in range(40)]  # ids 0..4, 8 times each
    for token_id in generated:
        row.append(token_id)
    assert row.output_id_array().tolist() == generated == row.output_token_ids
    assert row.prompt_token_ids.tolist() == [7]
    logits = torch.tensor([[10.0, 9.5, 9.0, 8.5, 8.0, 2.5, 1.5, 0.0]])
    # Ids 0..4 lose 8 each (2.0, 1.5, 1.0, 0.5, 0.0): id 5 (2.5), never generated, wins.
    assert Sampler()(logits, [row]).token_ids == [5]
    row.append(5)
    row.append(5)  # 2.5 - 2 = 0.5: now id 0 (2.0) wins
    assert Sampler()(logits, [row]).token_ids == [0]
    with pytest.raises(ValueError, match="penalties"):
        SequenceSampling(SamplingParams(temperature=0), [], vocab_size).output_id_array()


# -- greedy ---------------------------------------------------------------------------------------


def test_temperature_zero_is_argmax_whatever_else_is_set() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 100, generator=gen)
    greedy = SamplingParams(temperature=0, top_k=40, top_p=0.99, min_p=0.01, seed=5, logprobs=2)
    hot = SamplingParams(temperature=2.0, top_p=0.5, seed=1)
    seqs = [SequenceSampling(greedy if i % 2 else hot, [], 100) for i in range(16)]
    token_ids = Sampler()(logits, seqs).token_ids
    assert token_ids[1::2] == logits.argmax(-1)[1::2].tolist()


def test_temperature_below_the_epsilon_is_greedy() -> None:
    # 1e-44 as a float32 proto field delivers it: a subnormal that used to scale every logit to
    # +-inf, so the softmax was NaN and the draw the last column, every time.
    tiny = torch.tensor(1e-44, dtype=torch.float32).item()
    assert tiny > 0 and SamplingParams(temperature=tiny).is_greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 2).is_greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).is_greedy
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 100, generator=gen)
    cold = [SamplingParams(temperature=tiny, seed=i, top_k=50, logprobs=1) for i in range(4)]
    hot = [SamplingParams(temperature=1.0, seed=i) for i in range(4)]  # a random batch around
    for rows in (cold + cold, cold + hot):
        out = Sampler()(logits, [SequenceSampling(p, [], 100) for p in rows])
        assert out.token_ids[:4] == logits[:4].argmax(-1).tolist()
        assert out.logprobs is not None and all(math.isfinite(lp) for lp in out.logprobs)


# -- the tokenizer's ids only ---------------------------------------------------------------------

NUM_TOKENS, NUM_ROWS = 836, 896  # the demo model's tokenizer and embedding rows


def padded_logits(num_rows: int, seed: int) -> torch.Tensor:
    """[num_rows, NUM_ROWS] logits whose 60 padding columns are the most likely ones."""
    logits = torch.randn(num_rows, NUM_ROWS, generator=torch.Generator().manual_seed(seed))
    logits[:, NUM_TOKENS:] += 3.0
    return logits


def test_temperature_2_never_draws_a_padding_row() -> None:
    params = [
        SamplingParams(temperature=2.0, seed=1),
        SamplingParams(temperature=2.0, top_k=NUM_ROWS, top_p=0.999, min_p=0.001, seed=2),
        SamplingParams(temperature=2.0, repetition_penalty=0.5, frequency_penalty=-2.0, seed=3),
        SamplingParams(temperature=0, logprobs=20),
    ]
    seqs = [
        SequenceSampling(dataclasses.replace(p, seed=i), [NUM_TOKENS - 1, 5], NUM_TOKENS)
        for i, p in enumerate(params * 16)
    ]
    sampler, drawn = Sampler(NUM_TOKENS), []
    for step in range(25):  # 1600 draws
        logits = padded_logits(len(seqs), step)
        out = sampler(logits, seqs)
        drawn += out.token_ids
        for seq, token_id in zip(seqs, out.token_ids, strict=True):
            seq.append(token_id)
        assert out.top_logprobs is not None and out.logprobs is not None
        top = [i for row in out.top_logprobs for i, _ in row]
        assert top and max(top) < NUM_TOKENS  # logprobs never list a padding row either
        # ... but are normalized over every row, as HF's log_softmax and vLLM's logprobs.
        expected = logits.log_softmax(-1)
        chosen = expected.gather(-1, torch.tensor(out.token_ids).unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(torch.tensor(out.logprobs), chosen)
    assert max(drawn) < NUM_TOKENS
    assert len(set(drawn)) > 300  # a real spread, not one token
    # Without the tokenizer's size the same draws land on padding rows: the test can fail.
    hot = [SamplingParams(temperature=2.0, seed=i) for i in range(64)]
    unmasked = [SequenceSampling(p, [5], NUM_ROWS) for p in hot]
    assert max(Sampler()(padded_logits(64, 0), unmasked).token_ids) >= NUM_TOKENS


def test_sampler_refuses_logits_narrower_than_its_vocabulary() -> None:
    seq = SequenceSampling(SamplingParams(), [], NUM_TOKENS)
    with pytest.raises(ValueError, match="fewer than"):
        Sampler(NUM_TOKENS)(torch.zeros(1, NUM_TOKENS - 1), [seq])
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler(NUM_TOKENS)(torch.zeros(1, NUM_ROWS), [SequenceSampling(SamplingParams(), [], 9)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        seq.append(NUM_TOKENS)


# -- seeds ----------------------------------------------------------------------------------------


def step_logits(step: int, num_rows: int, vocab_size: int = 50) -> torch.Tensor:
    """The same pseudo-model output for a given step, whatever the batch."""
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(step))


def generate(params: SamplingParams, position: int, company: list[SamplingParams]) -> list[int]:
    """20 tokens for `params` sampled at batch `position` among `company` (other rows)."""
    rows = [*company[:position], params, *company[position:]]
    seqs = [SequenceSampling(p, [1, 2, 3], 50) for p in rows]
    sampler, tokens = Sampler(), []
    for step in range(20):
        logits = step_logits(step, len(rows))
        logits[position] = step_logits(step, 1)[0]  # our row sees the same logits every run
        tokens.append(run(sampler, logits, seqs)[position])
    return tokens


def test_same_seed_same_tokens_in_any_batch_position_and_company() -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.2, seed=1234)
    alone = generate(params, 0, [])
    others = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=5, seed=1234),
        SamplingParams(min_p=0.1, presence_penalty=1.0),
    ]
    assert generate(params, 2, others) == alone
    assert generate(params, 3, others) == alone
    assert len(set(alone)) > 5  # actually random, not stuck on one token
    other_seed = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.2, seed=1235)
    assert generate(other_seed, 0, []) != alone
    unseeded = SamplingParams(temperature=0.8)
    assert generate(unseeded, 0, []) != generate(unseeded, 0, [])


def test_resumed_sequence_continues_the_same_tokens() -> None:
    """Decode resuming what prefill started samples what a colocated run samples."""
    params = SamplingParams(frequency_penalty=0.5, seed=99)
    sampler = Sampler()
    whole = SequenceSampling(params, [4, 5], 50)
    tokens = [run(sampler, step_logits(step, 1), [whole])[0] for step in range(8)]
    resumed = SequenceSampling(params, [4, 5], 50, output_token_ids=tokens[:3])
    assert [run(sampler, step_logits(step, 1), [resumed])[0] for step in range(3, 8)] == tokens[3:]


# -- distribution ---------------------------------------------------------------------------------


def chi_square(token_ids: list[int], expected_probs: list[float]) -> float:
    n = len(token_ids)
    counts = torch.bincount(torch.tensor(token_ids), minlength=len(expected_probs)).tolist()
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, expected_probs, strict=True))


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), PROBS),
        # T = 0.5 squares the probabilities; top-k 3 renormalizes over the first three.
        (SamplingParams(temperature=0.5, top_k=3), [0.25 / 0.3125, 0.04 / 0.3125, 0.0225 / 0.3125]),
    ],
)
def test_sampled_frequencies_match_softmax(params: SamplingParams, expected: list[float]) -> None:
    num_draws = 20_000
    seqs = [
        SequenceSampling(SamplingParams(**{**params.__dict__, "seed": i}), [], 5)
        for i in range(num_draws)
    ]
    token_ids = Sampler()(sorted_rows(PROBS, num_draws), seqs).token_ids
    assert max(token_ids) < len(expected)  # filtered tokens never drawn
    # 99.9% quantile of chi-square with 4 (resp. 2) degrees of freedom: 18.47 (13.82).
    assert chi_square(token_ids, expected) < {5: 18.47, 3: 13.82}[len(expected)]


@pytest.mark.parametrize("vocab", [7, 256, 805, 3 * 256])  # one block, whole blocks, a tail
def test_inverse_cdf_in_blocks_draws_what_the_whole_row_cdf_draws(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    dense = (torch.randn(512, vocab, generator=g) * 3).softmax(-1)
    # Sparse rows (a constraint's mask): a few allowed tokens with whole blocks of 0 between
    # them; half of them allow the last token too (in the tail where there is one).
    sparse = torch.zeros(512, vocab)
    for i, row in enumerate(sparse):
        row[torch.randperm(vocab - 1, generator=g)[:3]] = torch.rand(3, generator=g) + 0.1
        row[vocab - 1] = 0.5 * (i % 2)
    probs = torch.cat([dense, sparse])
    u = torch.rand(len(probs), dtype=torch.float64, generator=g)
    for first in (0, 512):  # the extremes of u, dense and sparse
        u[first : first + 16] = 0.0
        u[first + 16 : first + 32] = 1 - 2**-53  # above any u the sampler makes (52 bits)
    drawn = inverse_cdf_in_blocks(probs, u)
    assert torch.equal(sample_inverse_cdf(probs, u), drawn)  # the CPU takes the blocks
    assert drawn.tolist() == inverse_cdf_whole_rows(probs, u).tolist()
    assert bool((probs.gather(1, drawn.unsqueeze(1)) > 0).all())  # never a 0-probability one


def test_inverse_cdf_stays_inside_a_block_whose_float32_sum_rounds_up() -> None:
    """The largest u picks the last allowed token, also where the float32 sum of its block is
    above the float64 running sum of the block's tokens (the target would land past them)."""
    g = torch.Generator().manual_seed(0)
    probs = torch.zeros(256, 1024)
    probs[:, 300:400] = torch.rand(256, 100, generator=g)  # the last token allowed: 399
    rounds_up = probs[:, 256:512].sum(-1).double() > probs[:, 256:512].double().sum(-1)
    assert rounds_up.any()  # the case this test is for
    drawn = sample_inverse_cdf(probs, torch.full((256,), 1 - 2**-53, dtype=torch.float64))
    assert drawn.tolist() == [399] * 256


def test_filters_keep_a_nan_row_in_range() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[1] = float("nan")
    ones = torch.ones(3, 1)
    for head_size in (None, 5):
        out = filter_logits(logits, torch.full((3, 1), 5), 0.9 * ones, 0 * ones, head_size)
        kept = (~out[[0, 2]].isinf()).sum(-1)
        assert bool(((kept >= 1) & (kept <= 5)).all())  # the other rows filtered as ever


def test_inverse_cdf_keeps_a_nan_row_in_range() -> None:
    probs = torch.full((2, 600), float("nan"))
    probs[1] = 0  # no mass at all
    drawn = sample_inverse_cdf(probs, torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert all(0 <= t < 600 for t in drawn.tolist())


# -- logprobs -------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_sorted_top_n() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    rows = [
        SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.5, seed=0),
        SamplingParams(logprobs=0, temperature=0),
        SamplingParams(),
        SamplingParams(logprobs=20, top_k=2, seed=1),
    ]
    seqs = [SequenceSampling(p, [0, 1, 2], 30) for p in rows]
    out = Sampler()(logits.to(torch.bfloat16), seqs)
    expected = logits.to(torch.bfloat16).float().log_softmax(-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    chosen = expected[torch.arange(4), torch.tensor(out.token_ids)]
    torch.testing.assert_close(torch.tensor(out.logprobs), chosen)
    assert [len(top) for top in out.top_logprobs] == [3, 0, 0, 20]
    for i in (0, 3):
        values, ids = expected[i].topk(len(out.top_logprobs[i]))
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in out.top_logprobs[i]]), values)
        assert [v for _, v in out.top_logprobs[i]] == sorted(
            (v for _, v in out.top_logprobs[i]), reverse=True
        )


def test_no_logprobs_when_nobody_asks() -> None:
    out = Sampler()(torch.zeros(2, 8), [SequenceSampling(SamplingParams(), [], 8)] * 2)
    assert out.logprobs is None and out.top_logprobs is None
    assert all(0 <= t < 8 for t in out.token_ids)


def test_shape_mismatch_rejected() -> None:
    seq = SequenceSampling(SamplingParams(), [], 8)
    with pytest.raises(ValueError, match="do not match"):
        Sampler()(torch.zeros(2, 8), [seq])
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler()(torch.zeros(1, 9), [seq])
    with pytest.raises(ValueError, match="prompt token ids"):
        SequenceSampling(SamplingParams(), [3, 8], 8)


# -- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_k", -1),
        ("top_k", 2.5),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("seed", 2**64),
        ("seed", 1.5),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("stop_token_ids", (1, -2)),
        ("ignore_eos", 1),
        ("logprobs", 21),
        ("logprobs", -1),
    ],
)
def test_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert [v.field for v in info.value.violations] == [field]
    assert str(info.value).startswith(f"{field}: ")


def test_seed_and_top_k_are_refused_outside_what_the_proto_carries() -> None:
    """uint64 seed, int32 top_k: a value past them is INVALID_ARGUMENT naming it, never a
    ValueError when the request is sent on."""
    for field, value in (("seed", -1), ("seed", 2**64), ("top_k", 2**31), ("top_k", -1)):
        with pytest.raises(InvalidArgument) as info:
            SamplingParams(**{field: value})
        assert [v.field for v in info.value.violations] == [field]
    assert sampling_params_to_proto(SamplingParams(seed=2**64 - 1, top_k=2**31 - 1)).seed


def test_validation_reports_every_bad_field() -> None:
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(temperature=-1, top_p=2, logprobs=50)
    assert [v.field for v in info.value.violations] == ["temperature", "top_p", "logprobs"]


def test_valid_params() -> None:
    params = SamplingParams(stop_token_ids=[7, 8], seed=5, logprobs=20, top_p=1, temperature=0)  # type: ignore[arg-type]
    assert params.stop_token_ids == (7, 8)
    assert params.is_greedy
    assert hash(params)  # frozen and hashable
