"""Sampler: one next token per row of a logits batch, each row with its own SamplingParams.

Vectorized over the batch and run entirely on the logits' device: per-row parameters travel in
one pinned host->device copy as [B, 1] columns, filters are thresholds read off each row's
largest logits (one sort of the rows, or torch.topk's head where every top-p row has a top-k),
and the chosen ids (with logprobs when asked) come back in one non-blocking copy. Nothing in
`Sampler.launch` waits for the device; `PendingSample.result()` is the one wait::

    raw logits ─┬─ log_softmax ──────────────────────────────────────────────▶ logprobs
                └─ penalties ─┬─ argmax ─────────────────────────────────────▶ greedy rows (T = 0)
                              └─ / T ─ top-k ─ top-p ─ min-p ─ softmax ─ CDF ─▶ random rows

Choices worth knowing:

- Only the tokenizer's ids are sampled: a checkpoint's embedding table is often padded past its
  tokenizer (Qwen3: 151,936 rows for 151,669 tokens; the demo model 896 for 836), and the
  padding rows carry logits like any other. The sampler reads the first `vocab_size` columns
  (a view of the logits: no copy, no host sync, the same shape every step, so CUDA graphs are
  unaffected), so no id at or past the tokenizer's size can be drawn, chosen by argmax or
  listed in top logprobs, and sampling probabilities are normalized over real tokens only.
  Logprobs keep the model's normalizer, every row's (below).
- Greedy means temperature below `sampling_params.GREEDY_TEMPERATURE` (1e-5, as vLLM), not
  just 0: a smaller temperature turns the scaled logits into +-inf (1e-44, a float32 subnormal,
  does) and the softmax into NaN, whose inverse CDF lands on the last column.
- Logprobs describe the model's raw distribution: log_softmax of the logits, over all the
  model's rows, before penalties, temperature and filters (vLLM's default too). They stay
  comparable across requests with different sampling settings, and equal what HF
  transformers reports for the same weights (an evaluation harness's loglikelihoods too).
- Random rows draw by inverse CDF: the first token, in vocabulary order, whose cumulative
  probability (float64) exceeds u x the row's total, which draws exactly from `probs` (a token
  of probability 0 is never chosen). u in [0, 1) is a counter-based draw: splitmix64 of (seed,
  output position), computed on the host without any generator state. A row's token therefore
  depends only on its logits, params, seed and position — not on its batch neighbours, not on
  how many draws came before, not on the device — so a decode service that resumes a request
  prefill started (passing `output_token_ids`) samples what a colocated run samples, and a
  seeded request samples the same tokens alone or in any batch.
- A constrained row (structured output) gets its grammar's token mask first: forbidden tokens
  logits become -inf before penalties, temperature and top-k/p/min-p, so greedy and random
  rows alike pick an allowed token and the seeded draw is unchanged in kind (the same u, over
  the masked distribution). The mask is applied in place on the logits handed in (a copy only
  when some row asks for logprobs, which stay those of the raw distribution).
- logit_bias: added to the row's logits before penalties, temperature and filters (after a
  constraint's mask: a forbidden token stays -inf); logprobs stay raw.
- min_tokens: until a row has generated that many tokens, its stop ids (the request's, and
  the model's EOS unless ignore_eos) get -inf like a mask's forbidden tokens, so no draw ends
  it early; logprobs stay those of the raw distribution.
- The sampler does not record the tokens it returns: the caller calls `seq.append(token_id)`
  for each row before the next step's sampling (penalties and the draw's position depend on
  it; the next step's forward may already run: ModelRunner.decode_logits' `ahead`).
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from mili.engine.constraint.mask import FilledMask, apply_token_bitmask
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.distribution import (
    apply_penalties,
    filter_logits,
    raw_logprobs,
    sample_inverse_cdf,
)
from mili.engine.step.pinned import DeviceToHost, to_device

__all__ = [
    "PendingSample",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SequenceSampling",
]

# The largest top-k whose filters are read off torch.topk's head instead of a sort of whole
# rows (the sort was most of a filtered batch's sampling: docs/benchmarks.md, "Sampler draw").
_MAX_FILTER_HEAD = 1024


# splitmix64's constants
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _uniforms(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Each row's draw u in [0, 1) for its next output position: seeds and output positions
    [B] uint64 -> [B] float64, splitmix64 of (seed, position) (numpy's uint64 arithmetic
    wraps), its top 52 bits, so that u x total stays below total in float64."""
    x = seeds + (positions + np.uint64(1)) * np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_MIX1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_MIX2)
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(12)).astype(np.float64) / 2.0**52


class SequenceSampling:
    """Mutable sampling state of one request: params, seed, and the token ids penalties see.

    `output_token_ids` lets a service resume a request started elsewhere (decode after prefill):
    the tokens generated so far count for penalties and advance the noise position.
    `stop_token_ids`: the ids that end this generation (Sequence's: the request's and the
    model's EOS unless ignore_eos; default the request's own), never drawn while fewer than
    `params.min_tokens` tokens were generated.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        vocab_size: int,
        output_token_ids: Sequence[int] = (),
        stop_token_ids: Collection[int] | None = None,
    ) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
        self.params = params
        self.vocab_size = vocab_size
        stops = params.stop_token_ids if stop_token_ids is None else stop_token_ids
        # The ids min_tokens holds back (ascending; none past the vocabulary, none without it).
        self.held_ids = np.array(
            sorted(i for i in stops if i < vocab_size) if params.min_tokens else [],
            dtype=np.int64,
        )
        # logit_bias as arrays: ids [n] int64 (none past the vocabulary), biases [n] float32
        bias = [(i, b) for i, b in params.logit_bias if i < vocab_size]
        self.bias_ids = np.array([i for i, _ in bias], dtype=np.int64)
        self.bias_values = np.array([b for _, b in bias], dtype=np.float32)
        self.seed: int = params.seed if params.seed is not None else secrets.randbits(64)
        # The row's first seven parameter columns (_PARAMS), fixed for the request: made once
        # here, not per step (a batch's block is built every step).
        self.param_column = (
            0.0 if params.is_greedy else params.temperature,  # greedy rows: exactly 0
            float(_top_k(params, vocab_size)),
            params.top_p,
            params.min_p,
            params.repetition_penalty,
            params.presence_penalty,
            params.frequency_penalty,
        )
        # Distinct prompt ids, ascending, int64: the prompt-presence mask repetition penalty
        # uses. Arrays, not lists: a penalised batch's index is built from them every step, and
        # from lists that costs ~0.1 us an id on the host (ms for a batch of long prompts).
        self.prompt_token_ids = np.unique(np.asarray(prompt_token_ids, dtype=np.int64))
        if self.prompt_token_ids.size and not (
            self.prompt_token_ids[0] >= 0 and self.prompt_token_ids[-1] < vocab_size
        ):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        self.output_token_ids: list[int] = []
        # The output ids again, as an array, for rows with penalties only (grown by doubling).
        self._penalty_ids = np.empty(16 if params.has_penalties else 0, dtype=np.int64)
        for token_id in output_token_ids:
            self.append(token_id)

    def append(self, token_id: int) -> None:
        """Record a generated token (the caller keeps it as this request's next output)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} outside the vocabulary [0, {self.vocab_size})")
        n = len(self.output_token_ids)
        self.output_token_ids.append(token_id)
        if self.params.has_penalties:
            if n == self._penalty_ids.size:
                self._penalty_ids = np.resize(self._penalty_ids, 2 * n)
            self._penalty_ids[n] = token_id

    def output_id_array(self) -> np.ndarray:
        """The output ids as int64 [n] (a view: valid until the next append); rows with
        penalties only."""
        if not self.params.has_penalties:
            raise ValueError("only a row with penalties keeps its output ids as an array")
        return self._penalty_ids[: len(self.output_token_ids)]


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    # Raw-model logprob of each chosen token; None when no row asked for logprobs.
    logprobs: list[float] | None
    # Per row, its top-n (token_id, logprob) most likely first, n = that row's params.logprobs
    # ([] for rows that asked for 0 or none); None when no row asked.
    top_logprobs: list[list[tuple[int, float]]] | None


# -- batch assembly -------------------------------------------------------------------------------


def _has_filters(p: SamplingParams) -> bool:
    return p.top_k != 0 or p.top_p < 1 or p.min_p > 0


def _top_k(p: SamplingParams, vocab_size: int) -> int:
    """The row's top-k as the filters take it: at most the vocabulary, and 0 (off) = V."""
    return min(p.top_k, vocab_size) or vocab_size


def _filter_head(params: Sequence[SamplingParams], vocab_size: int) -> int | None:
    """How many of each row's largest logits `filter_logits` reads its thresholds off: the
    largest top-k of the sampled rows, where every one with top-p has a top-k and none is
    above _MAX_FILTER_HEAD (None: sort whole rows). Greedy rows' filters do not count: their
    draw is discarded."""
    sampled = [p for p in params if not p.is_greedy]
    ks = [_top_k(p, vocab_size) for p in sampled]
    if any(k == vocab_size and p.top_p < 1 for k, p in zip(ks, sampled, strict=True)):
        return None
    n = max((k for k in ks if k < vocab_size), default=1)
    return n if n <= _MAX_FILTER_HEAD else None


def _cells(ids_per_row: list[tuple[int, np.ndarray]], device: torch.device) -> torch.Tensor:
    """The (row, id) cells of `ids_per_row` as a [2, n] int64 index on `device` (one copy)."""
    rows = np.concatenate([np.full(ids.size, row, dtype=np.int64) for row, ids in ids_per_row])
    ids = np.concatenate([ids for _, ids in ids_per_row])
    return to_device(np.stack([rows, ids]), torch.int64, device)


def _hold_back(logits: torch.Tensor, held: list[tuple[int, np.ndarray]]) -> None:
    """In place: -inf at each (row, id) of `held` (min_tokens: the stop ids a row may not draw
    yet). One copy of the index, no host sync."""
    if not held:
        return
    rows, ids = _cells(held, logits.device)
    logits.index_put_((rows, ids), logits.new_full((rows.numel(),), float("-inf")))


def _add_bias(logits: torch.Tensor, biased: list[tuple[int, SequenceSampling]]) -> None:
    """In place: each (row, id) of the rows' logit_bias gets its bias added. Two copies (the
    index, the biases), no host sync."""
    if not biased:
        return
    rows, ids = _cells([(row, s.bias_ids) for row, s in biased], logits.device)
    values = np.concatenate([s.bias_values for _, s in biased])
    logits.index_put_((rows, ids), logits[rows, ids] + to_device(values, logits.dtype, rows.device))


def _counts(ids_per_row: dict[int, np.ndarray], like: torch.Tensor) -> torch.Tensor:
    """[B, V] float like `like`: how often each id occurs in each listed row (others stay 0).
    ids_per_row: row -> int64 ids [n]."""
    counts = torch.zeros_like(like)
    vocab_size = like.shape[-1]
    # row * V + id, one entry per occurrence
    flat = [ids + row * vocab_size for row, ids in ids_per_row.items() if ids.size]
    if flat:
        index = to_device(np.concatenate(flat), torch.int64, like.device)
        counts.view(-1).scatter_add_(0, index, torch.ones_like(index, dtype=like.dtype))
    return counts


# Rows of the per-row parameter block sent to the device in one copy (float64, [8, B]).
_PARAMS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "u",
)


def param_rows(seqs: Sequence[SequenceSampling]) -> np.ndarray:
    """The rows of `_PARAMS` [8, B] float64 (top-k 0 = off = V; u = 0 for greedy rows)."""
    out = np.empty((8, len(seqs)))
    if not seqs:
        return out
    out[:7] = np.array([s.param_column for s in seqs]).T
    seeds = np.fromiter((s.seed for s in seqs), dtype=np.uint64, count=len(seqs))
    positions = np.fromiter(
        (len(s.output_token_ids) for s in seqs), dtype=np.uint64, count=len(seqs)
    )
    out[7] = np.where(out[0] == 0, 0.0, _uniforms(seeds, positions))
    return out


class DrawPlan(NamedTuple):
    """What a batch's draw launches besides its tensors: the same plan, the same kernels (a
    CUDA graph of the draw is keyed by it: sampler_graphs.py)."""

    is_random: bool  # some row is not greedy
    has_filters: bool  # some row has top-k, top-p or min-p
    head: int | None  # filter_logits' head_size (None: sort whole rows)


def draw_plan(params: Sequence[SamplingParams], vocab_size: int) -> DrawPlan:
    is_random = not all(p.is_greedy for p in params)
    has_filters = is_random and any(_has_filters(p) for p in params)
    return DrawPlan(
        is_random, has_filters, _filter_head(params, vocab_size) if has_filters else None
    )


def choose_tokens(
    logits: torch.Tensor, columns: torch.Tensor | None, plan: DrawPlan
) -> torch.Tensor:
    """Each row's token: logits [B, V] float32 (masked, biased and penalized already),
    columns [8, B, 1] float64 (_PARAMS; None only where no row is random) -> [B] int64.
    Greedy rows take the argmax; random ones ride along with T = 1 and draw from their filtered
    distribution, and keep the draw."""
    token_ids = logits.argmax(-1)  # [B]; final for greedy rows
    if not plan.is_random:
        return token_ids
    assert columns is not None
    temperature, top_k, top_p, min_p = columns[:4].float()
    is_greedy = temperature == 0  # [B, 1]
    # Greedy rows ride along with T = 1; their sampled token is discarded below.
    scaled = logits / torch.where(is_greedy, 1.0, temperature)
    if plan.has_filters:
        scaled = filter_logits(scaled, top_k.long(), top_p, min_p, plan.head)
    sampled = sample_inverse_cdf(scaled.softmax(-1), columns[7, :, 0])  # [B]
    return torch.where(is_greedy[:, 0], token_ids, sampled)


class PendingSample:
    """A launched sampling step: `result()` waits for its ids (and logprobs) to reach the host."""

    def __init__(
        self,
        token_ids: torch.Tensor,
        logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        wanted: list[int | None],
    ) -> None:
        # [B] int64 on the device: a forward launched before these ids reach the host feeds
        # them from here (ModelRunner.decode_logits' `ahead`)
        self.token_ids = token_ids
        tensors = [token_ids] if logprobs is None else [token_ids, *logprobs]
        self._copy = DeviceToHost(tensors)
        self._wanted = wanted

    def result(self) -> SamplerOutput:
        host = self._copy.wait()
        token_ids = host[0].tolist()
        if len(host) == 1:
            return SamplerOutput(token_ids, None, None)
        chosen, top_values, top_ids = (t.tolist() for t in host[1:])
        top = [
            list(zip(ids[: n or 0], values[: n or 0], strict=True))
            for ids, values, n in zip(top_ids, top_values, self._wanted, strict=True)
        ]
        return SamplerOutput(token_ids, chosen, top)


class Sampler:
    """Stateless: all per-request state lives in the SequenceSampling objects passed in.

    `vocab_size`: how many token ids the tokenizer has; logits columns past it (an embedding
    table's padding) are never sampled (see the module docstring). None: every column.
    """

    def __init__(self, vocab_size: int | None = None) -> None:
        if vocab_size is not None and vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
        self.vocab_size = vocab_size

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: Sequence[SequenceSampling],
        mask: FilledMask | None = None,
    ) -> SamplerOutput:
        """Sample and wait for the result (tests, prefill's first tokens, generate())."""
        return self.launch(logits, seqs, mask).result()

    def launch(
        self,
        logits: torch.Tensor,
        seqs: Sequence[SequenceSampling],
        mask: FilledMask | None = None,
    ) -> PendingSample:
        """Queue the sampling of one token per row on the logits' device; no host sync.

        logits: [B, V'], row i sampled with seqs[i].params; V' >= the sampler's vocab_size V
        (the model's rows), and only the first V columns count. `mask`: the constrained rows'
        token masks (mili.engine.constraint.mask), applied in place before anything else.
        """
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(seqs)} sequences")
        vocab_size = logits.shape[1] if self.vocab_size is None else self.vocab_size
        if logits.shape[1] < vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than {vocab_size}")
        if any(s.vocab_size != vocab_size for s in seqs):
            raise ValueError(f"not every row's vocab_size is the sampler's {vocab_size}")
        # raw: [B, V'], what logprobs describe (normalized over every row); logits: [B, V], a
        # view, so the padding columns cost nothing (float() is a no-op for float32). A mask,
        # hold or bias below writes into a copy when logprobs are asked: raw stays raw.
        raw = logits.float()
        logits = raw[:, :vocab_size]
        params = [s.params for s in seqs]
        device = logits.device
        plan = draw_plan(params, vocab_size)
        rows = [i for i, p in enumerate(params) if p.has_penalties]

        held = [
            (i, s.held_ids)
            for i, s in enumerate(seqs)
            if s.held_ids.size and len(s.output_token_ids) < s.params.min_tokens
        ]
        biased = [(i, s) for i, s in enumerate(seqs) if s.bias_ids.size]
        if mask is not None or held or biased:
            if any(p.logprobs is not None for p in params):
                logits = logits.clone()
            with torch.inference_mode():
                apply_token_bitmask(logits, mask)
                _hold_back(logits, held)
                _add_bias(logits, biased)
        penalized = logits
        columns: torch.Tensor | None = None  # [8, B, 1], see _PARAMS
        if rows or plan.is_random:
            block = to_device(param_rows(seqs), torch.float64, device)
            columns = block.unsqueeze(-1)
        if rows:
            assert columns is not None
            penalized = apply_penalties(
                logits,
                _counts({i: seqs[i].prompt_token_ids for i in rows}, logits) > 0,
                _counts({i: seqs[i].output_id_array() for i in rows}, logits),
                *columns[4:7].float(),
            )
        token_ids = choose_tokens(penalized, columns, plan)

        wanted = [p.logprobs for p in params]
        return PendingSample(token_ids, _logprobs(raw, token_ids, wanted, vocab_size), wanted)


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, wanted: list[int | None], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Chosen-token [B] and top-n [B, n_max] logprobs (values, ids) of the raw logits [B, V'],
    when any row asked (see the module docstring); rows cut their own n on the host."""
    if all(n is None for n in wanted):
        return None
    return raw_logprobs(logits, token_ids, max(n or 0 for n in wanted), vocab_size)
