"""The rules that shape a batch's next-token distributions and draw from them: pure tensor
functions over [B, V] logits, every per-row parameter a [B, 1] column (mili.engine.step.sampler
assembles the columns and calls them in order; its docstring says why each rule is so).

    apply_penalties      repetition (HF), presence and frequency (OpenAI)
    filter_logits        top-k, min-p, then top-p: thresholds read off each row's largest logits
    sample_inverse_cdf   one token a row for uniforms u, in two levels (no scan of whole rows)
    raw_logprobs         the one logprob rule (generated and prompt tokens alike)
    ranked_raw_logprobs  the same with the chosen tokens' ranks (prompt tokens)
    token_logprobs       the tokenizer's ids' logprobs, normalized over the model's every row
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Columns a block of sample_inverse_cdf's two-level search: its [B, C] scan stays short.
_CDF_BLOCK = 256
# The largest logit a repetition penalty may make: any penalty > 0 is valid, and a tiny one
# (1e-40) divides a positive logit past float32 (+inf, then a NaN softmax whose draw lands on the
# last column); below this the division by a temperature >= GREEDY_TEMPERATURE (1e-5) stays
# finite too. Seen tokens past it tie at it: all of them far likelier than the rest.
MAX_PENALIZED_LOGIT = 1e30


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
    penalized = penalized.clamp_(max=MAX_PENALIZED_LOGIT)
    logits = torch.where(seen, penalized, logits)
    return logits - frequency * output_counts - presence * is_generated


def filter_logits(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    head_size: int | None = None,
) -> torch.Tensor:
    """Set logits outside min-p and top-k, then outside top-p of what they kept, to -inf: vLLM's
    order (min-p is a ratio to the top token, which top-k always keeps, so those two commute;
    top-p's nucleus is taken over their survivors, renormalized).

    logits: [B, V] in vocabulary order; top_k: [B, 1] int64 in [1, V] (off = V); top_p: [B, 1]
    in (0, 1]; min_p: [B, 1].

    Each filter keeps the logits at or above a threshold of its row, so ties with it are kept
    (as HF does) and the kept set does not depend on how a sort orders equal values: top-k's
    k-th largest logit; min-p's, a probability min_p times the top token's; top-p's, the
    smallest logit whose mass strictly before it (in descending order, among the survivors) is
    < top_p, where top_p = 1 keeps everything (float sums can reach 1 before the tail does).
    The thresholds are read off the row's largest logits in order: the whole row sorted, or
    with `head_size` n only its n largest (torch.topk, no sort of the row; the sampler's
    `_filter_head` picks n), which is the same when every row's top-k is within n or off, and
    every row with top-p has a top-k (its nucleus is then inside its top-k, ties with the k-th
    aside, which carry the k-th's value and so follow the whole head).
    """
    n = logits.shape[1] if head_size is None else head_size
    if head_size is None:
        head = logits.sort(dim=-1, descending=True).values  # [B, n], descending
    else:
        head = logits.topk(n, dim=-1).values
    top = head[:, :1]  # [B, 1]
    kth = head.gather(-1, top_k.clamp(max=n) - 1).masked_fill(top_k > n, float("-inf"))
    # Top-k and min-p keep the logits >= `kept`: p >= min_p x p_top is logit >= top + log(min_p).
    kept = torch.maximum(kth, top + min_p.log())  # [B, 1]
    head_kept = head >= kept  # [B, n], a prefix of the head
    weights = (head - top).exp().masked_fill_(~head_kept, 0)  # p / p_top
    total = weights.sum(-1, keepdim=True)
    if head_size is not None:
        # Survivors past the head (ties with the k-th, when kept is it) carry kept's value: their
        # mass. (A row whose top-k is off has no top-p with a head: its total is never read.)
        past = (logits >= kept).sum(-1, keepdim=True, dtype=torch.int32)
        past -= head_kept.sum(-1, keepdim=True, dtype=torch.int32)
        total += past * (kept - top).exp()
    mass_before = (weights.cumsum(-1) - weights) / total  # 0 for the top token
    num_kept = (head_kept & (mass_before < top_p)).sum(-1, keepdim=True)  # >= 1
    # (0 only in a NaN row, whose draw is garbage anyway: kept in range, no device fault)
    cutoff = head.gather(-1, num_kept.clamp_(min=1) - 1)  # [B, 1], >= kept
    return logits.masked_fill(logits < torch.where(top_p < 1, cutoff, kept), float("-inf"))


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from `probs` [B, V] with the uniforms `u` [B] in [0, 1).

    The first token whose cumulative probability (float64) exceeds u x the row's total: a token
    of probability 0 is never chosen (its cumulative value equals its predecessor's), and the
    total absorbs the rounding of the softmax. -> [B] int64.

    Found in two levels, without a running sum over whole rows (torch's CUDA scan of [B, V]
    rows walks each row's tiles one after another on one CTA a row; docs/benchmarks.md,
    "Sampler draw"): the running sum of the blocks' sums (_CDF_BLOCK columns each,
    summed in float32) picks the block where the target falls, and only that block's [B, C]
    running sum is taken, the target kept below its total: a rounding never carries it past
    the block, and the token is always one of positive probability (`inverse_cdf_in_blocks`).
    A single CUDA row is scanned whole instead (`inverse_cdf_whole_rows`): torch hands one row
    to CUB's device-wide scan (no tiles in turn), one launch against the two levels' twenty-odd.
    """
    if probs.shape[0] == 1 and probs.is_cuda:
        return inverse_cdf_whole_rows(probs, u)
    return inverse_cdf_in_blocks(probs, u)


def inverse_cdf_in_blocks(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """sample_inverse_cdf's two levels: [B, V] probabilities and [B] uniforms -> [B] int64."""
    vocab = probs.shape[1]
    full = vocab // _CDF_BLOCK
    # [B, num_blocks] float32: blocks' sums (a view of the whole blocks; the tail its own)
    sums = probs[:, : full * _CDF_BLOCK].unflatten(1, (full, _CDF_BLOCK)).sum(-1)
    if full * _CDF_BLOCK < vocab:
        sums = torch.cat([sums, probs[:, full * _CDF_BLOCK :].sum(-1, keepdim=True)], dim=1)
    # [B, 1 + num_blocks]: the mass before each block, then the total
    block_cdf = F.pad(sums.double().cumsum(-1), (1, 0))
    total = block_cdf[:, -1:]
    target = u.double().unsqueeze(-1) * total  # < total: u * total never rounds up to it (u < 1)
    # The last block whose mass before it is <= target: [B, 1] in [0, num_blocks)
    # (The clamps keep a NaN row's indices in range: garbage, but no device-side fault.)
    block = (torch.searchsorted(block_cdf, target, right=True) - 1).clamp_(0, sums.shape[1] - 1)
    columns = block * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=probs.device)  # [B, C]
    # Columns past the vocabulary read its last token again: a draw reaches them only where
    # it picks that token (of positive probability), which the last clamp maps them back to.
    chosen = probs.gather(1, columns.clamp(max=vocab - 1))
    local_cdf = chosen.double().cumsum(-1)  # [B, C]
    # The block's float32 sum may round above its float64 running sum: stay below the latter.
    last = local_cdf[:, -1:]
    rest = torch.minimum(
        target - block_cdf.gather(1, block), torch.nextafter(last, last.new_zeros(()))
    )
    offset = torch.searchsorted(local_cdf, rest, right=True).clamp_(max=_CDF_BLOCK - 1)
    return columns.gather(1, offset).squeeze(-1).clamp_(max=vocab - 1)


def inverse_cdf_whole_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """sample_inverse_cdf's rule by one float64 running sum of whole [B, V] rows and a search
    (what a single CUDA row takes)."""
    cdf = probs.double().cumsum(-1)  # [B, V]
    target = (u.double() * cdf[:, -1]).unsqueeze(-1)  # [B, 1], < the total
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[1] - 1)


def raw_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one logprob rule, for generated and prompt tokens alike: log_softmax of the raw
    float32 logits [B, V'] over all the model's rows, read at the tokenizer's first
    `vocab_size` ids only (token_logprobs): the logprob of token_ids [B] -> [B], and the
    num_top most likely (values, ids) [B, num_top], most likely first."""
    return _chosen_and_top(token_logprobs(logits, vocab_size), token_ids, num_top)


def ranked_raw_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw_logprobs, and each chosen token's rank in its row, [B] int32: how many of the row's
    tokens' logprobs are >= its own, itself included (vLLM's rank: 1 for the most likely token;
    a token tied with others counts them all, so two tied at the top both rank 2)."""
    logprobs = token_logprobs(logits, vocab_size)  # [B, V]
    chosen, top_values, top_ids = _chosen_and_top(logprobs, token_ids, num_top)
    # int32: torch's default int64 sum of bools is the slower one on the CPU
    ranks = (logprobs >= chosen.unsqueeze(-1)).sum(-1, dtype=torch.int32)  # [B]
    return chosen, top_values, top_ids, ranks


def token_logprobs(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V'] raw logits -> [B, V] logprobs of the tokenizer's ids (a view). The normalizer
    is the whole row's, an embedding table's padding rows included, as in HF transformers'
    log_softmax and vLLM's logprobs, so an evaluation harness scores what it scores there.
    Ids past vocab_size are never named (nor sampled)."""
    return logits.log_softmax(-1)[:, :vocab_size]


def _chosen_and_top(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # [B]
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [B, num_top]
    return chosen, top_values, top_ids
