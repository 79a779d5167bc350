"""Shared by the constraint tests: the demo tokenizer as the grammar engine sees it, and a
sampler that draws from random logits under the masks (the constraint does all the work)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from mili.engine.constraint.compiler import CompiledConstraint
from mili.engine.constraint.mask import BatchMasker, apply_token_bitmask, unpack_bitmask
from mili.engine.constraint.vocab import GrammarTokenizer


def demo_grammar_tokenizer(model_dir: Path) -> GrammarTokenizer:
    rows = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    return GrammarTokenizer.from_file(model_dir / "tokenizer.json", rows, eos)


@dataclass
class Run:
    texts: list[str]
    finished: list[bool]
    steps: int


def sample(
    compiled: CompiledConstraint,
    hf: Tokenizer,
    seed: int,
    batch: int = 16,
    max_steps: int = 400,
    free_rows: int = 2,
) -> Run:
    """`batch` constrained rows (and `free_rows` unconstrained ones after them) sampled at
    temperature 1 from torch.randn logits until each matcher finishes or EOS is drawn.
    Checks every step: padded rows never allowed, EOS allowed exactly when the grammar can
    finish, unconstrained rows untouched."""
    tokenizer = compiled.tokenizer
    matchers = [compiled.matcher() for _ in range(batch)]
    masker = BatchMasker(tokenizer, batch + free_rows, num_threads=1)
    gen = torch.Generator().manual_seed(seed)
    ids: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    eos = list(tokenizer.eos_token_ids)
    steps = 0
    while not all(done) and steps < max_steps:
        steps += 1
        logits = torch.randn(batch + free_rows, tokenizer.vocab_rows, generator=gen)
        raw = logits.clone()
        rows = [None if done[i] else m for i, m in enumerate(matchers)] + [None] * free_rows
        mask = masker.fill(rows)
        assert mask is not None
        allowed = unpack_bitmask(mask.bitmask, tokenizer.vocab_rows)
        assert not allowed[:, tokenizer.num_tokens :].any(), "a padded row was allowed"
        for i, row in enumerate(mask.row_ids):
            can_finish = matchers[row].can_finish
            assert allowed[i, eos].tolist() == [can_finish] * len(eos), (row, can_finish)
        apply_token_bitmask(logits, mask)
        assert torch.equal(logits[batch:], raw[batch:]), "an unconstrained row was touched"
        probs = torch.softmax(logits[:batch], dim=-1)
        tokens = torch.multinomial(probs, 1, generator=gen).flatten().tolist()
        for i, token in enumerate(tokens):
            if done[i]:
                continue
            assert matchers[i].accept(token), matchers[i].error
            if token in eos:
                done[i] = True
            else:
                ids[i].append(token)
                done[i] = matchers[i].is_finished
    texts = [hf.decode(row_ids, skip_special_tokens=False) for row_ids in ids]
    return Run(texts, [m.is_finished for m in matchers], steps)


def sample_biased(
    compiled: CompiledConstraint, hf: Tokenizer, seed: int, bias: dict[int, float], batch: int = 8
) -> list[str]:
    """Random logits with a few tokens favoured (random text would run for about the
    vocabulary's size in tokens before </think> is drawn)."""
    tokenizer = compiled.tokenizer
    matchers = [compiled.matcher() for _ in range(batch)]
    masker = BatchMasker(tokenizer, batch, num_threads=1)
    gen = torch.Generator().manual_seed(seed)
    rows: list[list[int]] = [[] for _ in range(batch)]
    for _ in range(800):
        if all(m.is_finished for m in matchers):
            break
        logits = torch.randn(batch, tokenizer.vocab_rows, generator=gen)
        for token, add in bias.items():
            logits[:, token] += add
        apply_token_bitmask(logits, masker.fill([None if m.is_finished else m for m in matchers]))
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).flatten()
        for i, token in enumerate(tokens.tolist()):
            if matchers[i].is_finished:
                continue
            assert matchers[i].accept(token), matchers[i].error
            if token not in tokenizer.eos_token_ids:
                rows[i].append(token)
    assert all(m.is_finished for m in matchers)
    return [hf.decode(row, skip_special_tokens=False) for row in rows]
