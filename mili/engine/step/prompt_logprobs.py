"""Prompt logprobs: log p(prompt[i] | prompt[:i]) for the prompt's positions, computed from a
prefill chunk's hidden states a slice at a time.

    prompt of N tokens, chunk [start, end): hidden rows h[start] .. h[end - 1]
    h[j] predicts prompt[j + 1]  ->  targets prompt[start + 1 : min(end, N - 1) + 1]
    h[N - 1] predicts the first generated token: sampled, not a prompt logprob

    N = 7, chunks [0, 4) [4, 7):   targets p1 p2 p3 p4 | p5 p6      (N - 1 = 6 in all)

Logits of every position are [T, vocab] float32 (151,936 columns for Qwen3: 594 KiB a token), so
they are made ROWS_PER_PASS rows at a time and reduced at once to (chosen, its rank, top-n) by
the sampler's rule (distribution.ranked_raw_logprobs: the model's raw distribution, read at
the tokenizer's ids, as for generated tokens): the peak is one pass's logits, whatever the chunk's
length. The rank (vLLM's, which its OpenAI API reports for prompt tokens) needs the whole row,
so it is taken here, where the row is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from mili.engine.logprobs import TokenLogprobs
from mili.engine.step.distribution import ranked_raw_logprobs
from mili.engine.step.pinned import to_device

if TYPE_CHECKING:
    from mili.engine.model.kv_cache import KVCache
    from mili.engine.model.qwen3 import PrefillBatch, Qwen3ForCausalLM

# 256 x 151,936 x 4 B = 148 MiB of logits a pass (as much for log_softmax, a quarter of that for
# the ranks' comparison)
ROWS_PER_PASS = 256


class PromptLogprobsAsk(NamedTuple):
    """One chunk of a prefill batch whose prompt logprobs are wanted."""

    row: int  # the chunk's index in the batch
    target_ids: Sequence[int]  # chunk_targets(): the prompt tokens its positions predict
    num_top: int  # SamplingParams.prompt_logprobs


class PendingPromptLogprobs(NamedTuple):
    """One chunk's prompt logprobs on the device; `result()` brings them to the host."""

    chosen: torch.Tensor  # [t] float32: logprob of each target
    top_values: torch.Tensor  # [t, n] float32, most likely first
    top_ids: torch.Tensor  # [t, n] int64
    ranks: torch.Tensor  # [t] int32: each target's rank in its row (1: the most likely)

    def result(self) -> list[TokenLogprobs]:
        """One TokenLogprobs per target, in order (waits for the device)."""
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        top_values, top_ids = self.top_values.tolist(), self.top_ids.tolist()
        return [
            TokenLogprobs(lp, list(zip(ids, values, strict=True)), rank)
            for lp, ids, values, rank in zip(chosen, top_ids, top_values, ranks, strict=True)
        ]


def chunk_targets(prompt_token_ids: Sequence[int], start: int, end: int) -> Sequence[int]:
    """The prompt tokens that positions [start, end) of the prompt predict (see the module
    docstring): one per position but the prompt's last."""
    return prompt_token_ids[start + 1 : min(end + 1, len(prompt_token_ids))]


def compute_prompt_logprobs(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    target_ids: Sequence[int],
    vocab_size: int,
    num_top: int,
) -> PendingPromptLogprobs:
    """Queue the logprobs of `target_ids` given hidden rows [t, hidden] (row j predicts
    target j; rows past the targets are ignored), `logits_of` mapping hidden rows to float32
    logits [n, V' >= vocab_size], ROWS_PER_PASS of them at a time.
    Nothing here waits for the device."""
    num_targets = len(target_ids)
    device = hidden.device
    if num_targets > hidden.shape[0]:
        raise ValueError(f"{num_targets} targets for {hidden.shape[0]} hidden rows")
    if num_targets == 0:
        empty = torch.empty(0, num_top, device=device)
        no_ranks = torch.empty(0, dtype=torch.int32, device=device)
        return PendingPromptLogprobs(torch.empty(0, device=device), empty, empty.long(), no_ranks)
    targets = to_device(list(target_ids), torch.int64, device)
    parts = []
    for first in range(0, num_targets, ROWS_PER_PASS):
        last = min(first + ROWS_PER_PASS, num_targets)
        logits = logits_of(hidden[first:last]).float()  # [n, V']
        parts.append(ranked_raw_logprobs(logits, targets[first:last], num_top, vocab_size))
        del logits
    chosen, top_values, top_ids, ranks = (torch.cat(p) for p in zip(*parts, strict=True))
    return PendingPromptLogprobs(chosen, top_values, top_ids, ranks)


def prefill_with_prompt_logprobs(
    model: Qwen3ForCausalLM,
    batch: PrefillBatch,
    kv_cache: KVCache,
    chunk_lengths: Sequence[int],
    asks: Sequence[PromptLogprobsAsk],
    vocab_size: int,
    *,
    layer_callback: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, list[PendingPromptLogprobs]]:
    """The batch's prefill: its last-token logits [B, vocab] (as `model.prefill`), and the
    prompt logprobs of the chunks `asks` names (chunk_lengths: each chunk's tokens, in the
    batch's order): only their rows go through the head, a pass at a time, so a batch without
    asks costs what `model.prefill` does. The engine's runner and the single-process
    `generate` both prefill through this."""
    with torch.inference_mode():
        hidden = model.prefill_hidden(batch, kv_cache, layer_callback=layer_callback)  # [T, H]
        starts = [0]
        for length in chunk_lengths:
            starts.append(starts[-1] + length)
        logits = model.logits(hidden[batch.cu_seqlens[1:].long() - 1])  # [B, vocab]
        pending = [
            compute_prompt_logprobs(
                model.logits,
                hidden[starts[ask.row] : starts[ask.row + 1]],
                ask.target_ids,
                vocab_size,
                ask.num_top,
            )
            for ask in asks
        ]
    return logits, pending
