"""Single-process generation: the reference the services are tested against, and a baseline.

`generate()` runs every prompt through one packed prefill (optionally in chunks, exercising the
chunked-prefill path), then decode steps over all unfinished requests together, on a paged KV
cache whose blocks come from a `BlockPool`. Blocks are allocated as sequences grow (one more at
each block boundary) and all are freed when generation ends, even on error.

No scheduling, no preemption: if the pool runs dry, `BlockPoolExhausted` propagates. Size the
pool with `blocks_for_requests` (the default) to make that impossible.

Constrained requests (`SamplingParams.constraint`) are compiled by the `compiler` passed in and
masked at every sample, the first token's included, exactly as prefill and decode mask them
(here without overlapping the fill with the forward: this is the reference, not the fast path).
Prompt logprobs (`SamplingParams.prompt_logprobs`) come from the same computation prefill runs
(mili/engine/step/prompt_logprobs.py), chunk by chunk.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from mili.engine.constraint.compiler import ConstraintCompiler
from mili.engine.constraint.mask import BatchMasker
from mili.engine.kv.block_pool import BlockPool, blocks_needed
from mili.engine.kv.kv_layout import DEFAULT_BLOCK_SIZE
from mili.engine.logprobs import TokenLogprobs
from mili.engine.model.kv_cache import KVCache
from mili.engine.model.qwen3 import DecodeBatch, PrefillBatch, Qwen3ForCausalLM
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.prompt_logprobs import (
    PromptLogprobsAsk,
    chunk_targets,
    prefill_with_prompt_logprobs,
)
from mili.engine.step.sampler import Sampler, SamplerOutput
from mili.engine.step.sequence import Sequence


@dataclass
class GenerationResult:
    """One request's output. A stop/EOS token that ended generation is the last of token_ids."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop" (EOS or a stop token) or "length" (max_tokens)
    logprobs: list[float] | None = None  # per generated token, when params.logprobs is set
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # log p(prompt[i] | prompt[:i]) with the top params.prompt_logprobs, for i = 1 .. N - 1
    # (the first prompt token has none), when params.prompt_logprobs is set
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass
class GenerationStats:
    """Wall time spent in model calls (sampling included), for benchmarks and logs."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0  # sum of batch sizes over decode steps


def blocks_for_requests(
    prompts: Seq[Seq[int]], params: Seq[SamplingParams], block_size: int
) -> int:
    """Blocks that hold every request at its longest (prompt + max_tokens), all at once."""
    pairs = zip(prompts, params, strict=True)
    return sum(blocks_needed(len(p) + sp.max_tokens, block_size) for p, sp in pairs)


def generate(
    model: Qwen3ForCausalLM,
    prompts: Seq[Seq[int]],
    params: SamplingParams | Seq[SamplingParams],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_cache: KVCache | None = None,
    pool: BlockPool | None = None,
    prefill_chunk_size: int | None = None,
    stats: GenerationStats | None = None,
    vocab_size: int | None = None,
    compiler: ConstraintCompiler | None = None,
) -> list[GenerationResult]:
    """Generate for each prompt (token ids) with its SamplingParams; results in prompt order.

    `kv_cache` and `pool` default to a fresh pair sized by `blocks_for_requests` (with
    `block_size`); pass your own to observe them (the pool is back to all-free when this
    returns; the cache's own block size then applies). `prefill_chunk_size` splits
    prompts into chunks of at most that many tokens, each attending to the cached ones before it.
    `stats`, when given, accumulates timings. `vocab_size`: the tokenizer's number of token ids
    (`loader.tokenizer_vocab_size`), the ids sampled, as the services' runners do (default:
    every row of the model's embedding table). `compiler`: compiles the requests' constraints
    (required when any has one); a token a constraint refuses raises ConstraintError.
    """
    config = model.config
    vocab_size = config.vocab_size if vocab_size is None else vocab_size
    all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(all_params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(all_params)} SamplingParams")
    if prefill_chunk_size is not None and prefill_chunk_size < 1:
        raise ValueError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size}")
    for i, (prompt, sp) in enumerate(zip(prompts, all_params, strict=True)):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        if len(prompt) + sp.max_tokens > config.max_context_tokens:
            raise ValueError(
                f"prompt {i}: {len(prompt)} tokens + max_tokens {sp.max_tokens} exceeds "
                f"the model's context of {config.max_context_tokens} tokens"
            )
        sp.check_prompt(len(prompt))  # InvalidArgument: prompt_logprobs of too long a prompt
    if kv_cache is None:
        num_blocks = max(1, blocks_for_requests(prompts, all_params, block_size))
        kv_cache = KVCache(config, num_blocks, block_size, dtype=model.dtype, device=model.device)
    if pool is None:
        pool = BlockPool(kv_cache.num_blocks)
    if pool.num_blocks != kv_cache.num_blocks:
        raise ValueError(f"pool has {pool.num_blocks} blocks, cache {kv_cache.num_blocks}")

    eos_ids = sorted(model.eos_token_ids)  # the services' too (the loader sets them)
    masker = None
    if any(sp.constraint is not None for sp in all_params):
        if compiler is None:
            raise ValueError("a request has a constraint: pass a ConstraintCompiler")
        masker = BatchMasker(compiler.tokenizer, len(prompts))
    seqs = [
        Sequence.new(
            prompt,
            sp,
            vocab_size=vocab_size,
            eos_token_ids=eos_ids,
            matcher=None
            if sp.constraint is None or compiler is None
            else compiler.compile_sync(sp.constraint).matcher(),
        )
        for prompt, sp in zip(prompts, all_params, strict=True)
    ]
    results = [
        GenerationResult(
            token_ids=s.output_token_ids,
            logprobs=None if sp.logprobs is None else [],
            top_logprobs=None if sp.logprobs is None else [],
            prompt_logprobs=None if sp.prompt_logprobs is None else [],
        )
        for s, sp in zip(seqs, all_params, strict=True)
    ]
    sampler = _MaskedSampler(Sampler(vocab_size), masker)
    stats = stats if stats is not None else GenerationStats()
    try:
        start = time.perf_counter()
        asks = [sp.prompt_logprobs for sp in all_params]
        _prefill(
            model, kv_cache, pool, sampler, seqs, results, prefill_chunk_size, asks, vocab_size
        )
        stats.prefill_s += time.perf_counter() - start
        stats.num_prefill_tokens += sum(len(s.prompt_token_ids) for s in seqs)
        while active := [i for i, s in enumerate(seqs) if not s.is_finished]:
            start = time.perf_counter()
            _decode_step(model, kv_cache, pool, sampler, seqs, results, active)
            stats.decode_s += time.perf_counter() - start
            stats.num_decode_tokens += len(active)
    finally:
        for s in seqs:
            pool.free(s.block_table)
            s.block_table = []
    for s, result in zip(seqs, results, strict=True):
        result.finish_reason = s.finish_reason or ""
    return results


class _MaskedSampler:
    """The sampler, with each constrained row's mask filled first."""

    def __init__(self, sampler: Sampler, masker: BatchMasker | None) -> None:
        self.sampler = sampler
        self.masker = masker

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        mask = None if self.masker is None else self.masker.fill([s.matcher for s in seqs])
        return self.sampler(logits, [s.sampling for s in seqs], mask)


def _prefill(
    model: Qwen3ForCausalLM,
    kv_cache: KVCache,
    pool: BlockPool,
    sampler: _MaskedSampler,
    seqs: list[Sequence],
    results: list[GenerationResult],
    chunk_size: int | None,
    asks: list[int | None],
    vocab_size: int,
) -> None:
    """Prefill rounds: each round sends every unfinished prompt's next chunk in one batch, and
    the prompt logprobs (top asks[i]) of prompt i where asked (prompt_logprobs.py: only those
    chunks' rows go through the head, a pass at a time)."""
    block_size = kv_cache.block_size
    while pending := [
        i for i, s in enumerate(seqs) if s.num_computed_tokens < len(s.prompt_token_ids)
    ]:
        chunks = []
        for i in pending:
            s = seqs[i]
            end = len(s.prompt_token_ids)
            if chunk_size is not None:
                end = min(end, s.num_computed_tokens + chunk_size)
            _grow(pool, s, end, block_size)
            chunks.append(s.prompt_token_ids[s.num_computed_tokens : end])
        batch = PrefillBatch.build(
            chunks,
            [seqs[i].block_table for i in pending],
            block_size,
            start_positions=[seqs[i].num_computed_tokens for i in pending],
            device=model.device,
        )
        prompt_asks = []  # row j of the batch is prompt pending[j]
        for j, (i, chunk) in enumerate(zip(pending, chunks, strict=True)):
            if (num_top := asks[i]) is not None:
                start = seqs[i].num_computed_tokens
                targets = chunk_targets(seqs[i].prompt_token_ids, start, start + len(chunk))
                prompt_asks.append(PromptLogprobsAsk(j, targets, num_top))
        logits, pending_logprobs = prefill_with_prompt_logprobs(
            model, batch, kv_cache, [len(c) for c in chunks], prompt_asks, vocab_size
        )
        for ask, part in zip(prompt_asks, pending_logprobs, strict=True):
            asked = results[pending[ask.row]].prompt_logprobs
            assert asked is not None  # asks[i] is set: results[i] has a list
            asked.extend(part.result())
        for i, chunk in zip(pending, chunks, strict=True):
            seqs[i].num_computed_tokens += len(chunk)
        done = [
            j
            for j, i in enumerate(pending)
            if seqs[i].num_computed_tokens == len(seqs[i].prompt_token_ids)
        ]
        if done:
            _sample(sampler, logits[done], seqs, results, [pending[j] for j in done])


def _decode_step(
    model: Qwen3ForCausalLM,
    kv_cache: KVCache,
    pool: BlockPool,
    sampler: _MaskedSampler,
    seqs: list[Sequence],
    results: list[GenerationResult],
    active: list[int],
) -> None:
    """Feed each active sequence's newest token (at position num_tokens - 1); sample the next."""
    block_size = kv_cache.block_size
    for i in active:
        _grow(pool, seqs[i], seqs[i].num_tokens, block_size)
    batch = DecodeBatch.build(
        [seqs[i].output_token_ids[-1] for i in active],
        [seqs[i].num_tokens - 1 for i in active],
        [seqs[i].block_table for i in active],
        block_size,
        device=model.device,
    )
    _sample(sampler, model.decode(batch, kv_cache), seqs, results, active)


def _grow(pool: BlockPool, s: Sequence, num_tokens: int, block_size: int) -> None:
    """Make `s.block_table` cover `num_tokens` positions."""
    missing = blocks_needed(num_tokens, block_size) - len(s.block_table)
    if missing > 0:
        s.block_table.extend(pool.allocate(missing))


def _sample(
    sampler: _MaskedSampler,
    logits: torch.Tensor,
    seqs: list[Sequence],
    results: list[GenerationResult],
    rows: list[int],
) -> None:
    """Sample one token for each of seqs[rows] (logits row j is seqs[rows[j]])."""
    out = sampler.sample(logits, [seqs[i] for i in rows])
    for j, i in enumerate(rows):
        seqs[i].append(out.token_ids[j])  # its output list is results[i].token_ids
        result = results[i]
        if result.logprobs is not None and out.logprobs is not None:
            result.logprobs.append(out.logprobs[j])
        if result.top_logprobs is not None and out.top_logprobs is not None:
            result.top_logprobs.append(out.top_logprobs[j])
