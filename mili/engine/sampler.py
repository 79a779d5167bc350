"""Sampler: one next token per row of a logits batch, each row with its own SamplingParams.

Vectorized over the batch: per-row parameters become [B, 1] columns, filters are masks over one
sort of the logits, and only the random noise is drawn row by row (from each row's generator)::

    raw logits ─┬─ log_softmax ──────────────────────────────────────────────▶ logprobs
                └─ penalties ─┬─ argmax ─────────────────────────────────────▶ greedy rows (T = 0)
                              └─ / T ─ top-k ─ top-p ─ min-p ─ softmax ─ race ─▶ random rows

Choices worth knowing:

- Logprobs describe the model's raw distribution: log_softmax of the logits before penalties,
  temperature and filters (vLLM's default too). They stay comparable across requests with
  different sampling settings, and equal what HF transformers reports for the same weights.
- Random rows use the exponential race `argmax(probs / E)`, E ~ Exp(1) per token, which draws
  exactly from `probs`. E comes from the row's own generator, reseeded for every output position
  from (seed, position): a row's token depends only on its logits, params, seed and position —
  not on its batch neighbours, and not on how many draws came before, so a decode service that
  resumes a request prefill started (passing `output_token_ids`) samples what a colocated run
  samples.
- The sampler does not record the tokens it returns: the caller calls `seq.append(token_id)`
  for each row before the next step (penalties and the noise position depend on it).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mili.engine.sampling_params import SamplingParams

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SequenceSampling",
    "apply_penalties",
    "filter_logits",
    "min_p_mask",
    "top_k_mask",
    "top_p_mask",
]

_MASK64 = (1 << 64) - 1


def _step_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): the seed of the noise for output token `position`.

    Mixing all 64 bits matters: torch's CPU generator keeps only the low 32 bits of a seed.
    """
    x = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class SequenceSampling:
    """Mutable sampling state of one request: params, seed, and the token ids penalties see.

    `output_token_ids` lets a service resume a request started elsewhere (decode after prefill):
    the tokens generated so far count for penalties and advance the noise position.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        vocab_size: int,
        output_token_ids: Sequence[int] = (),
    ) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
        self.params = params
        self.vocab_size = vocab_size
        self.seed: int = params.seed if params.seed is not None else secrets.randbits(64)
        # Distinct prompt ids (CPU): the rows of the prompt-presence mask repetition penalty uses.
        self.prompt_token_ids = torch.tensor(list(prompt_token_ids), dtype=torch.long).unique()
        if len(self.prompt_token_ids) and not (
            self.prompt_token_ids[0] >= 0 and self.prompt_token_ids[-1] < vocab_size
        ):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        self.output_token_ids: list[int] = []
        self._generator: torch.Generator | None = None
        for token_id in output_token_ids:
            self.append(token_id)

    def append(self, token_id: int) -> None:
        """Record a generated token (the caller keeps it as this request's next output)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} outside the vocabulary [0, {self.vocab_size})")
        self.output_token_ids.append(token_id)

    def generator(self, device: torch.device) -> torch.Generator:
        """This request's generator on `device`, seeded for its next output position."""
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device)
        self._generator.manual_seed(_step_seed(self.seed, len(self.output_token_ids)))
        return self._generator


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    # Raw-model logprob of each chosen token; None when no row asked for logprobs.
    logprobs: list[float] | None
    # Per row, its top-n (token_id, logprob) most likely first, n = that row's params.logprobs
    # ([] for rows that asked for 0 or none); None when no row asked.
    top_logprobs: list[list[tuple[int, float]]] | None


# -- pure tensor functions: every per-row parameter is a [B, 1] column ----------------------------


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Repetition penalty (HF), then presence and frequency penalties (OpenAI).

    logits, output_counts: [B, V] float; prompt_mask: [B, V] bool; penalties: [B, 1].
    Repetition applies to every token seen in the prompt or the output; presence and frequency
    only to generated tokens. Default values (1, 0, 0) leave a row bit-for-bit unchanged.
    """
    is_generated = output_counts > 0
    seen = prompt_mask | is_generated
    # Dividing a positive logit and multiplying a negative one both make the token less likely.
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    return logits - frequency * output_counts - presence * is_generated


def top_k_mask(sorted_logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """True where a token falls outside the top k.

    sorted_logits: [B, V] sorted descending; top_k: [B, 1] int64 in [1, V] (off = V).
    Ties with the k-th logit are kept (as HF does), so the kept set does not depend on how the
    sort orders equal values.
    """
    kth = sorted_logits.gather(-1, top_k - 1)  # [B, 1]
    return sorted_logits < kth


def top_p_mask(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """True where a token falls outside the nucleus: the most likely tokens whose mass >= top_p.

    sorted_logits: [B, V] sorted descending (-inf for tokens already removed); top_p: [B, 1] in
    (0, 1]. A token is kept while the mass strictly before it is < top_p, plus ties with the last
    kept token; top_p = 1 keeps everything (float cumsums can reach 1 before the tail does).
    """
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # [B, V]; 0 for the first token, so >= 1 is kept
    num_kept = (mass_before < top_p).sum(-1, keepdim=True)  # [B, 1]
    cutoff = sorted_logits.gather(-1, num_kept - 1)  # [B, 1]
    return (sorted_logits < cutoff) & (top_p < 1)


def min_p_mask(sorted_logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """True where a token's probability is < min_p times the top token's (min_p: [B, 1])."""
    probs = sorted_logits.softmax(-1)  # [B, V]
    return probs < min_p * probs[:, :1]


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Set logits outside top-k, then top-p (of what top-k kept), then min-p to -inf.

    logits: [B, V] in vocabulary order; one sort serves all three masks. min-p is a ratio to
    the top token, so the renormalization by earlier filters does not change it.
    """
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [B, V] each
    remove = top_k_mask(sorted_logits, top_k)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    remove |= top_p_mask(sorted_logits, top_p) | min_p_mask(sorted_logits, min_p)
    remove = torch.zeros_like(remove).scatter(-1, sorted_ids, remove)  # back to vocab order
    return logits.masked_fill(remove, float("-inf"))


# -- batch assembly -------------------------------------------------------------------------------


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0


def _has_filters(p: SamplingParams) -> bool:
    return p.top_k != 0 or p.top_p < 1 or p.min_p > 0


def _counts(ids_per_row: dict[int, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """[B, V] float like `like`: how often each id occurs in each listed row (others stay 0)."""
    counts, device = torch.zeros_like(like), like.device
    if ids_per_row:
        lengths = torch.tensor([len(ids) for ids in ids_per_row.values()])
        rows = torch.repeat_interleave(torch.tensor(list(ids_per_row)), lengths).to(device)
        cols = torch.cat(list(ids_per_row.values())).to(device)
        counts.index_put_((rows, cols), torch.ones(len(cols), device=device), accumulate=True)
    return counts


def _penalize(logits: torch.Tensor, seqs: Sequence[SequenceSampling]) -> torch.Tensor:
    """apply_penalties with the prompt mask and output counts built from the rows that use them."""
    rows = [i for i, s in enumerate(seqs) if _has_penalties(s.params)]
    if not rows:
        return logits
    prompt_ids = {i: seqs[i].prompt_token_ids for i in rows}
    output_ids = {i: torch.tensor(seqs[i].output_token_ids, dtype=torch.long) for i in rows}
    params = [s.params for s in seqs]
    return apply_penalties(
        logits,
        _counts(prompt_ids, logits) > 0,
        _counts(output_ids, logits),
        _column([p.repetition_penalty for p in params], logits.device),
        _column([p.presence_penalty for p in params], logits.device),
        _column([p.frequency_penalty for p in params], logits.device),
    )


def _column(values: Sequence[float] | Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, device=device).unsqueeze(-1)  # [B, 1]


def _exponential_noise(seqs: Sequence[SequenceSampling], probs: torch.Tensor) -> torch.Tensor:
    """[B, V] Exp(1) noise for random rows, each from its own generator; 1 for greedy rows."""
    noise = torch.ones_like(probs)
    for i, seq in enumerate(seqs):
        if not seq.params.is_greedy:
            noise[i].exponential_(generator=seq.generator(probs.device))
    # Exp(1) can return exactly 0; probs / 0 would make a removed token's 0 / 0 = NaN win argmax.
    return noise.clamp_min_(torch.finfo(probs.dtype).tiny)


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
    """Chosen-token and top-n logprobs of the raw logits, for rows that asked (see module doc)."""
    wanted = [p.logprobs for p in params]
    if all(n is None for n in wanted):
        return None, None
    logprobs = logits.log_softmax(-1)  # [B, V]
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # [B]
    top_values, top_ids = logprobs.topk(max(n or 0 for n in wanted), dim=-1)  # [B, n_max]
    top = [
        list(zip(ids[: n or 0], values[: n or 0], strict=True))
        for ids, values, n in zip(top_ids.tolist(), top_values.tolist(), wanted, strict=True)
    ]
    return chosen.tolist(), top


class Sampler:
    """Stateless: all per-request state lives in the SequenceSampling objects passed in."""

    def __call__(self, logits: torch.Tensor, seqs: Sequence[SequenceSampling]) -> SamplerOutput:
        # logits: [B, V], row i sampled with seqs[i].params
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(seqs)} sequences")
        if any(s.vocab_size != logits.shape[-1] for s in seqs):
            raise ValueError(f"logits have {logits.shape[1]} columns, not every row's vocab_size")
        logits = logits.float()  # a no-op for float32: nothing below writes into it
        params = [s.params for s in seqs]
        device, vocab_size = logits.device, logits.shape[1]

        penalized = _penalize(logits, seqs)  # [B, V]
        token_ids = penalized.argmax(-1)  # [B]; final for greedy rows
        if not all(p.is_greedy for p in params):
            # Greedy rows ride along with T = 1; their sampled token is discarded below.
            scaled = penalized / _column([p.temperature or 1.0 for p in params], device)
            if any(_has_filters(p) for p in params):
                top_k = [min(p.top_k, vocab_size) or vocab_size for p in params]  # 0 = off = V
                scaled = filter_logits(
                    scaled,
                    _column(top_k, device),
                    _column([p.top_p for p in params], device),
                    _column([p.min_p for p in params], device),
                )
            probs = scaled.softmax(-1)  # [B, V]
            sampled = (probs / _exponential_noise(seqs, probs)).argmax(-1)  # [B]
            is_greedy = torch.tensor([p.is_greedy for p in params], device=device)
            token_ids = torch.where(is_greedy, token_ids, sampled)

        logprobs, top_logprobs = _logprobs(logits, token_ids, params)
        return SamplerOutput(token_ids.tolist(), logprobs, top_logprobs)
