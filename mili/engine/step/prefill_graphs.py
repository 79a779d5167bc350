"""The prefill step's forward as CUDA graphs, one per padded token count (prefill's service).

An eager forward of Qwen3-0.6B is some 300 launches, each a host call: on the GPU host they,
not the device, set the prefill step's time and bounded the service's throughput at high
concurrency (docs/benchmarks.md, run 6 and the checklist). A graph replays a step's launches
with one. What it needs (prefill_inputs.py): fixed addresses
(the static inputs, and one [S, vocab] float32 logits buffer every graph writes: the last token
of each of the S sequence rows) and fixed shapes: T tokens run at the smallest captured count
>= T, always S sequence rows, the padding on the null block.

Which steps replay: those of at most S chunks and the largest count's tokens, with no prompt
logprobs and no per-layer callback (a host KV sink ships each layer as it is computed: a graph
has no layers in between); the others run eagerly, as before. Counts are captured largest
first into one memory pool, so the smaller graphs reuse the largest one's intermediates.
`check` compares a replay with the eager forward on the same static inputs, and with the
eager forward of the prompt alone, at start-up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from mili.engine.kv.block_pool import blocks_needed
from mili.engine.model.kv_cache import KVCache
from mili.engine.model.qwen3 import PrefillBatch, Qwen3ForCausalLM
from mili.engine.step.cuda_graphs import capture_sizes
from mili.engine.step.prefill_inputs import PrefillInputs
from mili.plural import plural

_LOG = logging.getLogger("mili.engine")
# Sequence rows of every graph: a step of a few long prompts fits (run 6's saturated steps had
# about four); a step of more chunks runs eagerly. Each row costs its empty tiles' CTAs.
MAX_SEQS = 16
# Relative to the largest logit: a replay runs the eager forward's kernels on the same inputs;
# the prompt's own forward runs GEMMs of other shapes (other roundings in bf16), where a broken
# padding rule (a padded row read as a token, a padded sequence's rows written) is off by units.
_TOLERANCE = 1e-3
_PADDING_TOLERANCE = 5e-2


def prefill_token_sizes(max_tokens: int) -> tuple[int, ...]:
    """16, 32, ... doubling, with 1.5x steps from 256 on (384, 768, ...), up to and including
    `max_tokens`: ascending. Padding costs device time, at most a third of a step past 256."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    sizes: list[int] = []
    size = 16
    while size < max_tokens:
        sizes.append(size)
        if size >= 256 and size * 3 // 2 < max_tokens:
            sizes.append(size * 3 // 2)
        size *= 2
    sizes.append(max_tokens)
    return tuple(sizes)


class PrefillGraphs:
    """Captured prefill forwards by padded token count; `run` stages a step and replays."""

    def __init__(
        self,
        graphs: dict[int, torch.cuda.CUDAGraph],
        inputs: PrefillInputs,
        logits: torch.Tensor,
        memory_bytes: int,
    ) -> None:
        self._graphs = graphs
        self.inputs = inputs
        self.logits = logits  # [S, vocab] float32, written by every graph
        self.token_sizes = tuple(sorted(graphs))
        self.memory_bytes = memory_bytes
        self.num_replays = 0

    @classmethod
    def capture(
        cls,
        forward: Callable[[int], torch.Tensor],
        inputs: PrefillInputs,
        token_sizes: Sequence[int],
        vocab_size: int,
        device: torch.device,
    ) -> PrefillGraphs:
        """Capture `forward(size)` (the model over tokens [0, size) and every sequence row of
        `inputs`, returning [S, vocab] logits) for every size, largest first, on padding
        alone (only the null block is written)."""
        started = time.perf_counter()
        graphs, logits, memory_bytes = capture_sizes(
            forward,
            lambda size: inputs.fill([], [], [], size),
            token_sizes,
            (inputs.max_seqs, vocab_size),
            device,
        )
        _LOG.info(
            "captured %s of the prefill step (%s tokens, %s) in %.1f s, %.0f MiB",
            plural(len(graphs), "CUDA graph"),
            ", ".join(map(str, sorted(graphs))),
            plural(inputs.max_seqs, "sequence"),
            time.perf_counter() - started,
            memory_bytes / 2**20,
        )
        return cls(graphs, inputs, logits, memory_bytes)

    def size_for(self, token_ids: Sequence[Sequence[int]]) -> int | None:
        """The captured token count a step of these chunks replays at; None: none (too many
        chunks or tokens, or no chunk)."""
        total = sum(len(chunk) for chunk in token_ids)
        if not token_ids or len(token_ids) > self.inputs.max_seqs:
            return None
        return next((size for size in self.token_sizes if size >= total), None)

    def run(
        self,
        token_ids: Sequence[Sequence[int]],
        block_tables: Sequence[Sequence[int]],
        start_positions: Sequence[int],
        size: int,
    ) -> torch.Tensor:
        """Stage the chunks at `size` tokens (`size_for`) and replay: each chunk's last-token
        logits [B, vocab], a view of the static buffer (the next replay overwrites it)."""
        self.inputs.fill(token_ids, block_tables, start_positions, size)
        self._graphs[size].replay()
        self.num_replays += 1
        return self.logits[: len(token_ids)]

    def check(
        self,
        forward: Callable[[int], torch.Tensor],
        unpadded: Callable[[list[int], list[int]], torch.Tensor],
        block_table: list[int],
    ) -> str | None:
        """None when a replay of a prompt of a few tokens (in `block_table`'s blocks, padded to
        the smallest count) gives what the eager `forward` gives on the same static inputs,
        and, to a rounding, what the eager forward of the prompt alone gives (`unpadded`:
        [1, vocab]): the padding rules hold on this device's kernels. Else what went wrong."""
        size = self.token_sizes[0]
        prompt = [1, 2, 3, 4, 5][: max(1, min(5, size - 1))]
        try:
            self.inputs.fill([prompt], [block_table], [0], size)
            eager = forward(size)[:1].clone()
            self._graphs[size].replay()
            replayed = self.logits[:1].clone()
            alone = unpadded(prompt, block_table)
            scale = max(alone.abs().max().item(), 1.0)
            diff = (eager - replayed).abs().max().item()
            padding = (alone - replayed).abs().max().item()
        except Exception as e:  # whatever broke, eager prefill steps still serve
            return f"{type(e).__name__}: {e}"
        if not diff <= _TOLERANCE * scale:  # NaN fails too
            return f"a replay differs from the eager forward by {diff:.3g} (largest {scale:.3g})"
        if not padding <= _PADDING_TOLERANCE * scale:
            return (
                f"the padded step differs from the prompt's own forward by {padding:.3g} "
                f"(largest {scale:.3g})"
            )
        return None


def capture_prefill(
    model: Qwen3ForCausalLM, kv_cache: KVCache, max_tokens: int, null_block_id: int
) -> PrefillGraphs:
    """`model`'s prefill over `kv_cache` captured for counts up to `max_tokens`, and checked
    (a prompt in the null block); RuntimeError naming what went wrong where the check fails."""
    width = blocks_needed(model.config.max_context_tokens, kv_cache.block_size)
    inputs = PrefillInputs(
        max_tokens, MAX_SEQS, width, kv_cache.block_size, null_block_id, kv_cache.device
    )

    def forward(size: int) -> torch.Tensor:
        return model.prefill(inputs.batch(size), kv_cache)

    def unpadded(prompt: list[int], table: list[int]) -> torch.Tensor:
        batch = PrefillBatch.build([prompt], [table], kv_cache.block_size, device=kv_cache.device)
        return model.prefill(batch, kv_cache)

    graphs = PrefillGraphs.capture(
        forward, inputs, prefill_token_sizes(max_tokens), model.config.vocab_size, kv_cache.device
    )
    why = graphs.check(forward, unpadded, [null_block_id])
    if why is not None:
        raise RuntimeError(f"the check of a replay against the eager forward: {why}")
    return graphs
