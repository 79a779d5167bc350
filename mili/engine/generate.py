"""Single-process generation: the reference the services are tested against, and a baseline.

`generate()` runs every prompt through one packed prefill (optionally in chunks, exercising the
chunked-prefill path), then decode steps over all unfinished requests together, on a paged KV
cache whose blocks come from a `BlockPool`. Blocks are allocated as sequences grow (one more at
each block boundary) and all are freed when generation ends, even on error.

No scheduling, no preemption: if the pool runs dry, `BlockPoolExhausted` propagates. Size the
pool with `blocks_for_requests` (the default) to make that impossible.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mili.engine.block_pool import BlockPool, blocks_needed
from mili.engine.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from mili.engine.model import DecodeBatch, PrefillBatch, Qwen3ForCausalLM
from mili.engine.sampler import Sampler, SequenceSampling
from mili.engine.sampling_params import SamplingParams


@dataclass
class GenerationResult:
    """One request's output. A stop/EOS token that ended generation is the last of token_ids."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop" (EOS or a stop token) or "length" (max_tokens)
    logprobs: list[float] | None = None  # per generated token, when params.logprobs is set
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class GenerationStats:
    """Wall time spent in model calls (sampling included), for benchmarks and logs."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_steps: int = 0
    num_decode_tokens: int = 0  # sum of batch sizes over decode steps


@dataclass
class _Sequence:
    prompt: list[int]
    params: SamplingParams
    sampling: SequenceSampling
    stop_ids: frozenset[int]
    block_table: list[int] = field(default_factory=list)
    num_prefilled: int = 0  # prompt tokens whose K/V are in the cache
    result: GenerationResult = field(default_factory=GenerationResult)

    @property
    def is_finished(self) -> bool:
        return bool(self.result.finish_reason)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.result.token_ids)


def blocks_for_requests(
    prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], block_size: int
) -> int:
    """Blocks that hold every request at its longest (prompt + max_tokens), all at once."""
    pairs = zip(prompts, params, strict=True)
    return sum(blocks_needed(len(p) + sp.max_tokens, block_size) for p, sp in pairs)


def generate(
    model: Qwen3ForCausalLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_cache: KVCache | None = None,
    pool: BlockPool | None = None,
    prefill_chunk_size: int | None = None,
    stats: GenerationStats | None = None,
) -> list[GenerationResult]:
    """Generate for each prompt (token ids) with its SamplingParams; results in prompt order.

    `kv_cache` and `pool` default to a fresh pair sized by `blocks_for_requests` (with
    `block_size`); pass your own to observe them (the pool is back to all-free when this
    returns; the cache's own block size then applies). `prefill_chunk_size` splits
    prompts into chunks of at most that many tokens, each attending to the cached ones before it.
    `stats`, when given, accumulates timings.
    """
    config = model.config
    all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(all_params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(all_params)} SamplingParams")
    for i, (prompt, sp) in enumerate(zip(prompts, all_params, strict=True)):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        if len(prompt) + sp.max_tokens > config.max_position_embeddings:
            raise ValueError(
                f"prompt {i}: {len(prompt)} tokens + max_tokens {sp.max_tokens} exceeds "
                f"max_position_embeddings {config.max_position_embeddings}"
            )
    if kv_cache is None:
        num_blocks = max(1, blocks_for_requests(prompts, all_params, block_size))
        kv_cache = KVCache(config, num_blocks, block_size, dtype=model.dtype, device=model.device)
    if pool is None:
        pool = BlockPool(kv_cache.num_blocks)
    if pool.num_blocks != kv_cache.num_blocks:
        raise ValueError(f"pool has {pool.num_blocks} blocks, cache {kv_cache.num_blocks}")

    eos = config.eos_token_id
    eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
    seqs = [
        _Sequence(
            prompt=list(prompt),
            params=sp,
            sampling=SequenceSampling(sp, prompt, config.vocab_size),
            stop_ids=frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else eos_ids),
            result=GenerationResult(
                logprobs=None if sp.logprobs is None else [],
                top_logprobs=None if sp.logprobs is None else [],
            ),
        )
        for prompt, sp in zip(prompts, all_params, strict=True)
    ]
    sampler = Sampler()
    stats = stats if stats is not None else GenerationStats()
    try:
        start = time.perf_counter()
        _prefill(model, kv_cache, pool, sampler, seqs, prefill_chunk_size)
        stats.prefill_s += time.perf_counter() - start
        stats.num_prefill_tokens += sum(len(s.prompt) for s in seqs)
        while active := [s for s in seqs if not s.is_finished]:
            start = time.perf_counter()
            _decode_step(model, kv_cache, pool, sampler, active)
            stats.decode_s += time.perf_counter() - start
            stats.num_decode_steps += 1
            stats.num_decode_tokens += len(active)
    finally:
        for s in seqs:
            pool.free(s.block_table)
            s.block_table = []
    return [s.result for s in seqs]


def _prefill(
    model: Qwen3ForCausalLM,
    kv_cache: KVCache,
    pool: BlockPool,
    sampler: Sampler,
    seqs: list[_Sequence],
    chunk_size: int | None,
) -> None:
    """Prefill rounds: each round sends every unfinished prompt's next chunk in one batch."""
    block_size = kv_cache.block_size
    while pending := [s for s in seqs if s.num_prefilled < len(s.prompt)]:
        chunks = []
        for s in pending:
            end = (
                len(s.prompt)
                if chunk_size is None
                else min(len(s.prompt), s.num_prefilled + chunk_size)
            )
            _grow(pool, s, end, block_size)
            chunks.append(s.prompt[s.num_prefilled : end])
        batch = PrefillBatch.build(
            chunks,
            [s.block_table for s in pending],
            block_size,
            start_positions=[s.num_prefilled for s in pending],
            device=model.device,
        )
        logits = model.prefill(batch, kv_cache)  # [B, vocab]
        for s, chunk in zip(pending, chunks, strict=True):
            s.num_prefilled += len(chunk)
        done = [i for i, s in enumerate(pending) if s.num_prefilled == len(s.prompt)]
        if done:
            _sample(sampler, logits[done], [pending[i] for i in done])


def _decode_step(
    model: Qwen3ForCausalLM,
    kv_cache: KVCache,
    pool: BlockPool,
    sampler: Sampler,
    active: list[_Sequence],
) -> None:
    """Feed each sequence's newest token (at position num_tokens - 1) and sample the next."""
    block_size = kv_cache.block_size
    for s in active:
        _grow(pool, s, s.num_tokens, block_size)
    batch = DecodeBatch.build(
        [s.result.token_ids[-1] for s in active],
        [s.num_tokens - 1 for s in active],
        [s.block_table for s in active],
        block_size,
        device=model.device,
    )
    _sample(sampler, model.decode(batch, kv_cache), active)


def _grow(pool: BlockPool, s: _Sequence, num_tokens: int, block_size: int) -> None:
    """Make `s.block_table` cover `num_tokens` positions."""
    missing = blocks_needed(num_tokens, block_size) - len(s.block_table)
    if missing > 0:
        s.block_table.extend(pool.allocate(missing))


def _sample(sampler: Sampler, logits: torch.Tensor, seqs: list[_Sequence]) -> None:
    out = sampler(logits, [s.sampling for s in seqs])
    for i, s in enumerate(seqs):
        token = out.token_ids[i]
        result = s.result
        result.token_ids.append(token)
        s.sampling.append(token)
        if result.logprobs is not None and out.logprobs is not None:
            result.logprobs.append(out.logprobs[i])
        if result.top_logprobs is not None and out.top_logprobs is not None:
            result.top_logprobs.append(out.top_logprobs[i])
        if token in s.stop_ids:
            result.finish_reason = "stop"
        elif len(result.token_ids) >= s.params.max_tokens:
            result.finish_reason = "length"
