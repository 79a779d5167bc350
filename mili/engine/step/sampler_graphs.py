"""The sampling of graph steps as CUDA graphs, beside the forwards' (cuda_graphs.py for decode,
prefill_graphs.py for prefill's first tokens).

Eagerly, sampling a batch is some thirty launches (the mask's copy and unpacking, the
temperature, the filters, the two-level draw: sampler.py), each a host call; on the GPU host
that was as long as the constrained step's forward (docs/benchmarks.md, "Structured output on a
GPU"). Where the logits are rows of a graphs' static buffer and the batch's sampling is the
draw alone (`graph_plan`: no penalties, logit_bias, min_tokens hold or logprobs; a mask on
every row or none), the launch is one replay:

    key = (padded size, DrawPlan, the mask buffer's address or None)
    (greedy and temperature alone without a mask: captured at every size at start-up, `prepare`)
    1st batch of a key: eager (the capture's warm-up: lazy initialisation happens there)
    2nd: captured, replayed, and checked token for token against the eager sampling of the
         same logits; a graph that differs is dropped (a warning) and its key stays eager
    later: the host writes the [8, size] parameter block into the graph's pinned memory and
         replays: a copy of it and of the mask rows, the mask, the draw

A graph samples all `size` rows of the padded batch; padded rows are greedy (argmax, their
token never read). Graphs share one memory pool and the static logits, so they replay one at a
time on the decode thread's stream, in order with its forwards (what an eager sampling relies
on too). The masker's buffer is read at replay time, as the eager path's non-blocking copy
reads it: the masker refills it only after the step's ids are back. A graph's parameter block
is written only once its previous replay's copy of it has run (an event).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mili.engine.constraint.mask import FilledMask, unpack_bitmask
from mili.engine.step.buckets import padded_batch_size
from mili.engine.step.sampler import (
    DrawPlan,
    PendingSample,
    Sampler,
    SamplingParams,
    SequenceSampling,
    choose_tokens,
    draw_plan,
    param_rows,
)

_LOG = logging.getLogger("mili.engine")
# Most graphs kept: batch sizes x plans x mask buffers seen; past it, new keys run eagerly.
_MAX_GRAPHS = 512
_FAILED = object()  # a key whose capture failed or whose graph disagreed: eager from now on


def graph_plan(
    seqs: Sequence[SequenceSampling], mask: FilledMask | None, vocab_size: int
) -> DrawPlan | None:
    """The batch's plan where its sampling is the draw alone, after a mask on every row or on
    none (what a graph of it replays); None where it needs more: penalties, min_tokens' held
    ids, logit_bias, logprobs, a mask on some rows only."""
    if mask is not None and mask.row_ids != list(range(len(seqs))):
        return None
    for s in seqs:
        p = s.params
        if (
            p.has_penalties
            or p.logprobs is not None
            or s.bias_ids.size
            or (s.held_ids.size and len(s.output_token_ids) < p.min_tokens)
        ):
            return None
    return draw_plan([s.params for s in seqs], vocab_size)


def param_block(seqs: Sequence[SequenceSampling], vocab_size: int, out: np.ndarray) -> None:
    """Write the rows of sampler._PARAMS into out [8, >= len(seqs)] float64: the batch's columns,
    then greedy padding (a padded row of a graph's batch: argmax, no filter, its token unused)."""
    n = len(seqs)
    out[:, :n] = param_rows(seqs)
    out[:, n:] = np.array([0.0, vocab_size, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])[:, None]


def sample_padded(
    logits: torch.Tensor, block: torch.Tensor, bits: torch.Tensor | None, plan: DrawPlan
) -> torch.Tensor:
    """What a sampler graph runs: logits [size, V] float32 (masked in place), block [8, size]
    float64 (sampler._PARAMS), bits [size, words] int32 mask rows or None -> [size] int64.
    The eager launch's work for a batch of `plan`, on the padded rows too."""
    if bits is not None:
        logits.masked_fill_(~unpack_bitmask(bits, logits.shape[1]), float("-inf"))
    return choose_tokens(logits, block.unsqueeze(-1), plan)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    host: torch.Tensor  # [8, size] float64, pinned: the parameter block the graph copies in
    # [8, size] float64 on the device, where the graph copies `host` to: allocated before the
    # capture, so held here (freed, its memory would go to other tensors the replays overwrite)
    block: torch.Tensor
    token_ids: torch.Tensor  # [size] int64 on the device, written by each replay
    copied: torch.cuda.Event  # recorded after each replay: the host block is free again

    def replay(self, seqs: list[SequenceSampling], vocab_size: int) -> None:
        self.copied.synchronize()  # the last replay's copy of `host` has run
        param_block(seqs, vocab_size, self.host.numpy())
        self.graph.replay()
        self.copied.record()


class SamplerGraphs:
    """Graph replays of the sampling of steps whose logits are `logits`' rows."""

    def __init__(
        self, sampler: Sampler, logits: torch.Tensor, batch_sizes: tuple[int, ...]
    ) -> None:
        """`logits`: the static output [rows, V'] float32 of a set of graphs on CUDA (the
        decode graphs', the prefill graphs'); `batch_sizes`: ascending, the largest <= rows
        (a batch of B samples at the smallest >= B)."""
        if sampler.vocab_size is None:
            raise ValueError("a sampler graph needs the sampler's vocab_size")
        self._sampler = sampler
        self._vocab_size = sampler.vocab_size
        self._logits = logits
        self._batch_sizes = batch_sizes
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[object, ...], _Graph | object] = {}
        self._seen: set[tuple[object, ...]] = set()  # keys sampled once, eagerly
        self.num_replays = 0  # launches that were replays (tests, benchmarks)

    def reads(self, logits: torch.Tensor) -> bool:
        """Whether `logits` are rows of the static buffer these graphs read."""
        return logits.data_ptr() == self._logits.data_ptr()

    @property
    def num_graphs(self) -> int:
        return sum(isinstance(g, _Graph) for g in self._graphs.values())

    def prepare(self) -> None:
        """Capture the two commonest plans, greedy and temperature alone, at every batch size
        now (start-up), so that a service's first batches of each size do not pay a capture
        (a device sync in the middle of a step). Over random logits written into the static
        buffer (the decode graphs' next replay overwrites them), each graph checked as ever."""
        generator = torch.Generator(device=self._logits.device).manual_seed(0)
        self._logits.normal_(generator=generator)
        for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=0)):
            for size in self._batch_sizes:
                seqs = [SequenceSampling(params, [0], self._vocab_size) for _ in range(size)]
                before = self.num_graphs
                for _ in range(2):  # eager (the warm-up), then the capture
                    self.launch(self._logits[:size], seqs, None).result()
                if self.num_graphs == before:
                    break  # its warning said why; the plan's other sizes would fail alike

    def launch(
        self, logits: torch.Tensor, seqs: list[SequenceSampling], mask: FilledMask | None
    ) -> PendingSample:
        """Sampler.launch's result for `logits` [B, V'] (rows [0, B) of the static buffer or
        anything else), by a graph where one applies, else eagerly."""
        key_and_bits = self._key(logits, seqs, mask)
        if key_and_bits is None:
            return self._sampler.launch(logits, seqs, mask)
        key, bits = key_and_bits
        entry = self._graphs.get(key)
        if isinstance(entry, _Graph):
            entry.replay(seqs, self._vocab_size)
            self.num_replays += 1
            n = len(seqs)
            return PendingSample(entry.token_ids[:n], None, [None] * n)
        if entry is _FAILED or key not in self._seen or len(self._graphs) >= _MAX_GRAPHS:
            self._seen.add(key)
            return self._sampler.launch(logits, seqs, mask)
        return self._capture(key, bits, logits, seqs, mask)

    def _key(
        self, logits: torch.Tensor, seqs: list[SequenceSampling], mask: FilledMask | None
    ) -> tuple[tuple[object, ...], torch.Tensor | None] | None:
        """(the batch's key, the mask rows a graph of it reads), or None where no graph
        applies: logits not the static buffer's first rows, a plan beyond the draw, a mask
        buffer with fewer rows than the padded batch."""
        n = len(seqs)
        static = self._logits
        if (
            logits.data_ptr() != static.data_ptr()
            or logits.stride() != static.stride()
            or logits.dtype != static.dtype
            or not 0 < n <= self._batch_sizes[-1]
        ):
            return None
        plan = graph_plan(seqs, mask, self._vocab_size)
        if plan is None:
            return None
        size = padded_batch_size(n, self._batch_sizes)
        if mask is None:
            return (size, plan, None), None
        # The masker's buffer: rows [n, size) hold other steps' masks, which only padded
        # (greedy, unread) rows get.
        bitmask = mask.bitmask
        words = bitmask.shape[1]
        if (
            not bitmask.is_contiguous()
            or bitmask.untyped_storage().nbytes()
            < (bitmask.storage_offset() + size * words) * bitmask.element_size()
        ):
            return None
        bits = bitmask.as_strided((size, words), (words, 1))
        return (size, plan, bits.data_ptr()), bits

    def _capture(
        self,
        key: tuple[object, ...],
        bits: torch.Tensor | None,
        logits: torch.Tensor,
        seqs: list[SequenceSampling],
        mask: FilledMask | None,
    ) -> PendingSample:
        """Capture the key's graph, replay it on this batch and keep it only if its tokens are
        the eager sampling's; the eager sampling is what this batch gets either way."""
        size, plan = key[0], key[1]
        assert isinstance(size, int) and isinstance(plan, DrawPlan)
        device = logits.device
        try:
            entry = self._record(size, plan, bits, device)
            entry.replay(seqs, self._vocab_size)
            eager = self._sampler.launch(logits, seqs, mask)
            graph_ids = entry.token_ids[: len(seqs)].tolist()
            eager_ids = eager.result().token_ids
        except Exception as e:  # whatever broke the capture, eager sampling still serves
            self._graphs[key] = _FAILED
            _LOG.warning(
                "sampler graph of batch %d %s failed, it samples eagerly: %s: %s",
                size,
                plan,
                type(e).__name__,
                e,
            )
            return self._sampler.launch(logits, seqs, mask)
        if graph_ids != eager_ids:
            self._graphs[key] = _FAILED
            _LOG.warning(
                "sampler graph of batch %d %s drew %s where eager sampling drew %s: dropped, "
                "it samples eagerly",
                size,
                plan,
                graph_ids[:8],
                eager_ids[:8],
            )
        else:
            self._graphs[key] = entry
        return eager

    def _record(
        self, size: int, plan: DrawPlan, bits: torch.Tensor | None, device: torch.device
    ) -> _Graph:
        host = torch.empty((8, size), dtype=torch.float64, pin_memory=True)
        param_block([], self._vocab_size, host.numpy())  # all padding until the first write
        block = torch.empty((8, size), dtype=torch.float64, device=device)
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)  # the forward that writes the logits is queued there
        with torch.cuda.stream(side):
            # thread_local: the decode service's other threads (KV landing) keep using the
            # device while this thread captures.
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                block.copy_(host, non_blocking=True)
                on_device = None if bits is None else bits.to(device, non_blocking=True)
                logits = self._logits[:size, : self._vocab_size]
                token_ids = sample_padded(logits, block, on_device, plan)
            finally:
                graph.capture_end()
        current.wait_stream(side)
        return _Graph(graph, host, block, token_ids, torch.cuda.Event())
