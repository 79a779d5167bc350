"""Constraints where sampling happens: the sampler's mask (exact tokens), the sequence's stop
and refusal, the masker's thread, and single-process generate() under a constraint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from mili.engine.constraint.compiler import ConstraintCompiler
from mili.engine.constraint.mask import BatchMasker, FilledMask
from mili.engine.constraint.matcher import ConstraintError
from mili.engine.constraint.spec import Constraint
from mili.engine.generate import generate
from mili.engine.model.loader import load_model, tokenizer_vocab_size
from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.sampler import Sampler, SequenceSampling
from mili.engine.step.sequence import Sequence
from mili.engine.stop import FinishReason, check_stop
from tests.engine.constraint_helpers import demo_grammar_tokenizer

V = 100
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer"},
        "kind": {"enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "kind"],
}


def hand_mask(allowed: dict[int, list[int]], vocab: int = V) -> FilledMask:
    """A FilledMask allowing `allowed[row]` in each listed row."""
    rows = sorted(allowed)
    bits = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int64)
    for i, row in enumerate(rows):
        for token in allowed[row]:
            bits[i, token // 32] |= 1 << (token % 32)
    as_int32 = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return FilledMask(as_int32, rows)


def masked_by_hand(logits: torch.Tensor, allowed: dict[int, list[int]]) -> torch.Tensor:
    out = logits.clone()
    for row, tokens in allowed.items():
        keep = torch.full((logits.shape[1],), float("-inf"))
        keep[tokens] = 0.0
        out[row] = out[row] + keep
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_sampler_mask_picks_what_a_hand_masked_row_picks(temperature: float) -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    allowed = {0: [3, 10, 57], 2: [7]}  # rows 1 and 3 unconstrained
    params = SamplingParams(temperature=temperature, top_k=20, seed=11, logprobs=2)
    seqs = [SequenceSampling(params, [1, 2], V) for _ in range(4)]
    sampler = Sampler(V)
    by_hand = sampler(masked_by_hand(logits, allowed), seqs)
    out = sampler(logits.clone(), seqs, hand_mask(allowed))
    assert out.token_ids == by_hand.token_ids  # same seeds, same draws, masked distribution
    assert out.token_ids[0] in allowed[0] and out.token_ids[2] == 7
    unmasked = sampler(logits.clone(), seqs)
    assert [out.token_ids[i] for i in (1, 3)] == [unmasked.token_ids[i] for i in (1, 3)]
    # logprobs stay those of the raw distribution (the mask works on a copy then)
    raw = logits.log_softmax(-1)
    assert out.logprobs is not None
    for row, token in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(raw[row, token].item(), abs=1e-5)


def test_sampler_without_logprobs_masks_in_place() -> None:
    logits = torch.randn(2, V)
    seqs = [SequenceSampling(SamplingParams(temperature=0), [1], V) for _ in range(2)]
    assert Sampler(V)(logits, seqs, hand_mask({1: [4]})).token_ids[1] == 4
    assert torch.isinf(logits[1]).sum() == V - 1 and not torch.isinf(logits[0]).any()


def test_check_stop_constraint_finished_wins_over_length() -> None:
    kw = {"stop_token_ids": {0}, "max_tokens": 3}
    assert check_stop(5, 1, **kw, is_constraint_finished=True) is FinishReason.STOP
    assert check_stop(5, 3, **kw, is_constraint_finished=True) is FinishReason.STOP
    assert check_stop(5, 3, **kw) is FinishReason.LENGTH


@pytest.fixture(scope="module")
def compiler(demo_model_dir: Path) -> ConstraintCompiler:
    return ConstraintCompiler(demo_grammar_tokenizer(demo_model_dir))


@pytest.fixture(scope="module")
def hf(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))


def test_sequence_accepts_stops_and_refuses(compiler: ConstraintCompiler) -> None:
    tok = compiler.tokenizer
    params = SamplingParams(max_tokens=50, constraint=Constraint.choice(["yes", "no"]))
    assert params.constraint is not None
    matcher = compiler.compile_sync(params.constraint).matcher()
    seq = Sequence.new(
        [1], params, vocab_size=tok.num_tokens, eos_token_ids=tok.eos_token_ids, matcher=matcher
    )
    ids = tok.encode("yes")
    bad = tok.encode("x")[0]
    with pytest.raises(ConstraintError, match=r"sampling\.choice"):
        seq.append(bad)
    assert seq.output_token_ids == []  # nothing recorded
    reasons = [seq.append(t) for t in ids]
    assert reasons[:-1] == [None] * (len(ids) - 1) and reasons[-1] is FinishReason.STOP


def test_masker_start_skips_unconstrained_batches(compiler: ConstraintCompiler) -> None:
    masker = BatchMasker(compiler.tokenizer, 2)
    assert masker.start([None, None]) is None
    matcher = compiler.compile_sync(Constraint.regex("[0-9]+")).matcher()
    future = masker.start([None, matcher, None])
    assert future is not None
    threaded = future.result()
    assert threaded.row_ids == [1]
    bitmask = threaded.bitmask.clone()
    again = masker.fill([None, matcher])
    assert again is not None and torch.equal(again.bitmask, bitmask)
    masker.close()


@pytest.fixture(scope="module")
def demo(demo_model_dir: Path) -> tuple[Qwen3ForCausalLM, int]:
    model = load_model(demo_model_dir, device=torch.device("cpu"), dtype=torch.float32)
    vocab = tokenizer_vocab_size(demo_model_dir)
    assert vocab is not None
    return model, vocab


def test_generate_under_constraints(
    demo: tuple[Qwen3ForCausalLM, int], compiler: ConstraintCompiler, hf: Tokenizer
) -> None:
    model, vocab = demo
    schema = Constraint.json_schema(SCHEMA)
    regex = Constraint.regex("[a-z]{2,4}-[0-9]{1,3}")
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=200, constraint=schema) for s in range(6)
    ] + [SamplingParams(temperature=1.0, seed=s, max_tokens=40, constraint=regex) for s in (1, 2)]
    params.append(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # unconstrained
    before = compiler.stats()
    prompts = [[5, 6, 7]] * len(params)
    results = generate(model, prompts, params, vocab_size=vocab, compiler=compiler)
    after = compiler.stats()
    assert after.misses - before.misses <= 2  # one compile per distinct constraint
    for r in results[:6]:
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(hf.decode(r.token_ids)), SCHEMA)
    for r in results[6:8]:
        assert r.finish_reason == "stop"
        text = hf.decode([t for t in r.token_ids if t not in compiler.tokenizer.eos_token_ids])
        assert re.fullmatch("[a-z]{2,4}-[0-9]{1,3}", text), text
    assert results[8].finish_reason == "length" and len(results[8].token_ids) == 8


def test_generate_needs_a_compiler_for_constraints(demo: tuple[Qwen3ForCausalLM, int]) -> None:
    model, vocab = demo
    params = SamplingParams(max_tokens=4, constraint=Constraint.json_object())
    with pytest.raises(ValueError, match="ConstraintCompiler"):
        generate(model, [[5]], params, vocab_size=vocab)
