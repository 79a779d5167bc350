"""ModelRunner: the one object prefill's worker and decode's batcher drive.

It owns the model, the KV cache tensors, the decode step's static inputs and (on CUDA, over a
graph-safe attention backend) the decode step's CUDA graphs, and it samples. Which blocks
are free is not its business: the services' bookkeeping holds a
`BlockPool(runner.num_blocks, null_block=True)`, whose null block is the cache's last one.

    startup.load_runner: weights -> warm-up at the largest batch (CUDA) -> KV pool sized
          (kv_memory) -> KV cache -> CUDA graphs per padded batch size (cuda_graphs)

    prefill(chunks) -> logits                     eager: shapes follow the prompts
    prefill_step(chunks, prompt_logprobs=asks)    the same, with the asking chunks' prompt
        -> PrefillOutput                          logprobs (a pass of logits at a time)
    decode(seqs)    -> PendingSample              inputs staged into static buffers, graph
                                                  replay (or eager), sampling (a graph replay
                                                  too where sampler_graphs has one); no host
                                                  sync (but a sampler graph's capture)
    decode_logits(seqs, ahead=Launched(...))      the forward alone, launched before the
                                                  previous step's ids reach the host: rows in
                                                  both feed its ids; sample() once appended
    PendingSample.result()                        the step's one wait: ids back on the host

One thread drives a runner: its buffers are reused step after step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import NamedTuple

import torch

from mili.engine.constraint.mask import FilledMask
from mili.engine.kv.block_pool import blocks_needed
from mili.engine.kv_memory import GIB
from mili.engine.model.kv_cache import KVCache, bytes_per_block
from mili.engine.model.qwen3 import PrefillBatch, Qwen3ForCausalLM
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.buckets import graph_batch_sizes, padded_batch_size
from mili.engine.step.cuda_graphs import DecodeGraphs
from mili.engine.step.decode_inputs import DecodeInputs
from mili.engine.step.pinned import is_pinnable
from mili.engine.step.prefill_graphs import PrefillGraphs, capture_prefill
from mili.engine.step.prompt_logprobs import (
    PendingPromptLogprobs,
    PromptLogprobsAsk,
    chunk_targets,
    prefill_with_prompt_logprobs,
)
from mili.engine.step.sampler import PendingSample, Sampler, SequenceSampling
from mili.engine.step.sampler_graphs import SamplerGraphs
from mili.engine.step.sequence import Sequence as EngineSequence

_LOG = logging.getLogger("mili.engine")


class Launched(NamedTuple):
    """A decode step whose sampled ids the host has not appended yet."""

    seqs: Sequence[EngineSequence]  # its rows, in order
    sample: PendingSample  # their ids, on the device (and on their way to the host)


class PrefillOutput(NamedTuple):
    """What `prefill_step` queued on the device (nothing waited for)."""

    logits: torch.Tensor  # [B, vocab] float32: each chunk's last token
    prompt_logprobs: list[PendingPromptLogprobs]  # one per ask, in the asks' order


class ModelRunner:
    """Model + KV cache + static decode inputs (+ CUDA graphs); see the module docstring.

    `kv_cache`'s last block is the null block (padded rows of a graph's batch use it); the
    blocks before it are the pool's. `max_decode_batch`: the most sequences in one decode step.
    `vocab_size`: the tokenizer's number of token ids, the ids sampled and accepted (default:
    every row of the model's embedding table, which may be padded past the tokenizer's).
    """

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        kv_cache: KVCache,
        *,
        max_decode_batch: int,
        vocab_size: int | None = None,
    ) -> None:
        if kv_cache.num_blocks < 2:
            raise ValueError("the KV cache needs a block for the pool and the null block")
        num_rows = model.config.vocab_size
        self.vocab_size = num_rows if vocab_size is None else vocab_size
        if not 0 < self.vocab_size <= num_rows:
            raise ValueError(
                f"the tokenizer's {self.vocab_size} token ids do not fit the model's "
                f"{num_rows} embedding rows"
            )
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.null_block_id = kv_cache.num_blocks - 1
        self.batch_sizes = graph_batch_sizes(max_decode_batch)  # padded sizes, for graphs
        # W: the block table of a request at the longest context the model allows.
        width = blocks_needed(model.config.max_context_tokens, self.block_size)
        self.inputs = DecodeInputs(
            self.batch_sizes[-1], width, self.block_size, self.null_block_id, model.device
        )
        self.sampler = Sampler(self.vocab_size)
        self.sampler_graphs: SamplerGraphs | None = None  # with the decode graphs
        self.prefill_graphs: PrefillGraphs | None = None  # prefill's service, on CUDA
        # the first tokens' sampling, from the prefill graphs' logits
        self.prefill_sampler_graphs: SamplerGraphs | None = None
        self.graphs: DecodeGraphs | None = None

    @classmethod
    def create(
        cls,
        model: Qwen3ForCausalLM,
        num_blocks: int,
        block_size: int,
        *,
        max_decode_batch: int = 1,
        vocab_size: int | None = None,
    ) -> ModelRunner:
        """A runner over a model already loaded, with a fresh pool of `num_blocks` blocks
        (plus the null block), eager (tests, benchmarks)."""
        cache = KVCache(
            model.config, num_blocks + 1, block_size, dtype=model.dtype, device=model.device
        )
        return cls(model, cache, max_decode_batch=max_decode_batch, vocab_size=vocab_size)

    # ---- what it holds -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks the pool hands out (the null block not counted)."""
        return self.null_block_id

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of those blocks, all layers, K and V."""
        config, dtype = self.model.config, self.kv_cache.dtype
        return self.num_blocks * bytes_per_block(config, self.block_size, dtype)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def describe(self, *, decode: bool = True) -> str:
        """The KV pool (and with `decode` how decode steps run), for start-up logs."""
        pool = (
            f"{self.num_blocks} KV blocks of {self.block_size} tokens "
            f"({self.kv_cache_bytes / GIB:.2f} GiB)"
        )
        if not decode:
            return pool
        if self.graphs is None:
            return f"{pool}; decode eager"
        sizes = self.graphs.batch_sizes
        return f"{pool}; decode CUDA graphs for batch {sizes[0]}..{sizes[-1]} ({len(sizes)})"

    # ---- steps ---------------------------------------------------------------------------------

    def prefill(
        self,
        token_ids: Sequence[Sequence[int]],
        block_tables: Sequence[Sequence[int]],
        start_positions: Sequence[int],
        *,
        all_logits: bool = False,
        layer_callback: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Prompt chunks (PrefillBatch.build's arguments) -> float32 logits, eagerly.

        The batch is built on the host and moved through pinned memory, so the host goes on
        launching layers while it travels.
        """
        batch = self._prefill_batch(token_ids, block_tables, start_positions)
        return self.model.prefill(
            batch, self.kv_cache, all_logits=all_logits, layer_callback=layer_callback
        )

    def prefill_step(
        self,
        token_ids: Sequence[Sequence[int]],
        block_tables: Sequence[Sequence[int]],
        start_positions: Sequence[int],
        *,
        prompt_logprobs: Sequence[PromptLogprobsAsk] = (),
        layer_callback: Callable[[int], None] | None = None,
    ) -> PrefillOutput:
        """`prefill`'s last-token logits, and the prompt logprobs of the chunks `prompt_logprobs`
        asks for: only their rows go through the head, a pass at a time (prompt_logprobs.py),
        so a batch without asks costs what `prefill` does. A step with neither asks nor a
        `layer_callback` replays a prefill graph where one holds it (prefill_graphs.py)."""
        graphs = self.prefill_graphs
        if graphs is not None and not prompt_logprobs and layer_callback is None:
            size = graphs.size_for(token_ids)
            if size is not None:
                with torch.inference_mode():
                    logits = graphs.run(token_ids, block_tables, start_positions, size)
                return PrefillOutput(logits, [])
        batch = self._prefill_batch(token_ids, block_tables, start_positions)
        logits, pending = prefill_with_prompt_logprobs(
            self.model,
            batch,
            self.kv_cache,
            [len(chunk) for chunk in token_ids],
            prompt_logprobs,
            self.vocab_size,
            layer_callback=layer_callback,
        )
        return PrefillOutput(logits, pending)

    def _prefill_batch(
        self,
        token_ids: Sequence[Sequence[int]],
        block_tables: Sequence[Sequence[int]],
        start_positions: Sequence[int],
    ) -> PrefillBatch:
        batch = PrefillBatch.build(
            token_ids, block_tables, self.block_size, start_positions=start_positions
        )
        if is_pinnable(self.device):
            batch = PrefillBatch(
                *(t.pin_memory().to(self.device, non_blocking=True) for t in batch)
            )
        return batch

    def sample(
        self,
        logits: torch.Tensor,
        seqs: Sequence[SequenceSampling],
        mask: FilledMask | None = None,
    ) -> PendingSample:
        """One token per row of `logits` [B, vocab], queued (under the constrained rows'
        `mask`); `.result()` waits for them.

        Everything that reads `logits` is queued here, on the caller's stream, before this
        returns: under CUDA graphs `logits` is the graphs' static buffer, which the next
        `decode_logits` (launched ahead, before this sample's result is in) overwrites. Sampling
        on another stream or thread, or reading the logits lazily in `result()`, would race it."""
        with torch.inference_mode():  # no autograd bookkeeping on the host's path
            return self._launch_sample(logits, seqs, mask)

    def decode(
        self,
        seqs: Sequence[EngineSequence],
        masks: Future[FilledMask] | FilledMask | None = None,
    ) -> PendingSample:
        """Launch one decode step of `seqs` and its sampling; nothing here waits for the device.

        Sequence i feeds its newest token at position num_tokens - 1 (its block_table covers
        it). The caller appends each sampled token (`result()`) before the next step (or
        launches the next forward first: `decode_logits`' `ahead`).
        `masks`: the constrained rows' token masks, or their fill still running (BatchMasker's
        `start`): waited for only once the forward is launched (on CUDA) or done (on the CPU,
        where the fill thread ran beside it), then applied before sampling.
        """
        with torch.inference_mode():
            logits = self.decode_logits(seqs)
            mask = masks.result() if isinstance(masks, Future) else masks
            return self._launch_sample(logits, [s.sampling for s in seqs], mask)

    def _launch_sample(
        self,
        logits: torch.Tensor,
        seqs: Sequence[SequenceSampling],
        mask: FilledMask | None,
    ) -> PendingSample:
        """The sampler's launch, as a graph replay where the logits are the decode or the
        prefill graphs' and one applies (sampler_graphs.py)."""
        for graphs in (self.sampler_graphs, self.prefill_sampler_graphs):
            if graphs is not None and graphs.reads(logits):
                return graphs.launch(logits, list(seqs), mask)
        return self.sampler.launch(logits, seqs, mask)

    def decode_logits(
        self,
        seqs: Sequence[EngineSequence],
        num_rows: int | None = None,
        *,
        ahead: Launched | None = None,
    ) -> torch.Tensor:
        """Launch the decode step's forward: logits [len(seqs), vocab] float32.

        With graphs, the step replays the graph of the batch's padded size. Without, it runs
        eagerly on exactly the batch's rows, or padded to `num_rows` rows over the block
        tables' full width: the graph's computation, eagerly (tests compare the two).

        `ahead`: a step whose ids the host has not appended yet. A sequence in it feeds the
        token it sampled there, on the device, at position num_tokens, so this forward runs
        while the host waits for those ids; append them before sampling these logits
        (`sample`: penalties, constraint masks and the seeded draw's position read them).
        Such a sequence must not be `is_length_bound()` (its reservation ends there); one the
        pending token stops is the caller's to discard.
        """
        sources = self._sources(seqs, ahead)
        n = len(seqs)
        sampled = None if ahead is None else ahead.sample.token_ids
        with torch.inference_mode():
            if self.graphs is not None and num_rows is None:
                size = padded_batch_size(n, self.graphs.batch_sizes)
                self.inputs.fill(seqs, size, sources, sampled)
                return self.graphs.replay(size)[:n]
            if num_rows is not None:
                self.inputs.fill(seqs, num_rows, sources, sampled)
                return self.model.decode(self.inputs.batch(num_rows), self.kv_cache)[:n]
            width = self.inputs.fill(seqs, n, sources, sampled)
            return self.model.decode(self.inputs.batch(n, width), self.kv_cache)

    @staticmethod
    def _sources(seqs: Sequence[EngineSequence], ahead: Launched | None) -> list[int] | None:
        """Each sequence's row in `ahead` (-1: not in it); None when no sequence is."""
        if ahead is None:
            return None
        rows = {id(seq): row for row, seq in enumerate(ahead.seqs)}
        sources = [rows.get(id(seq), -1) for seq in seqs]
        if all(i < 0 for i in sources):
            return None
        for seq, i in zip(seqs, sources, strict=True):
            if i >= 0 and seq.is_length_bound():
                raise ValueError("a sequence its pending token ends cannot run another step")
        return sources

    # ---- start-up ------------------------------------------------------------------------------

    def capture_graphs(self) -> bool:
        """Capture the decode step for every padded batch size (CUDA, graph-safe backend).

        A capture that fails (a kernel that syncs or allocates in a way the capture refuses,
        a driver error) leaves the runner eager, with a warning: False. Decode steps are then
        slower, not wrong.
        """

        def forward(size: int) -> torch.Tensor:
            return self.model.decode(self.inputs.batch(size), self.kv_cache)

        def fill_padding(size: int) -> None:
            self.inputs.fill([], size)

        try:
            with torch.inference_mode():
                self.graphs = DecodeGraphs.capture(
                    forward,
                    fill_padding,
                    self.batch_sizes,
                    self.model.config.vocab_size,
                    self.device,
                )
        except Exception as e:  # whatever broke the capture, eager steps still serve
            self.graphs = None
            _LOG.warning(
                "CUDA graph capture of the decode step failed, decode steps run eagerly: %s: %s",
                type(e).__name__,
                e,
            )
            return False
        # The sampling of graph steps (sampler_graphs.py): the commonest plans now, the others
        # as batches come.
        sampler_graphs = SamplerGraphs(self.sampler, self.graphs.logits, self.batch_sizes)
        try:
            with torch.inference_mode():
                sampler_graphs.prepare()
        except Exception as e:  # the decode graphs stand; the sampling stays eager
            _LOG.warning("sampler graphs off, sampling runs eagerly: %s: %s", type(e).__name__, e)
            return True
        self.sampler_graphs = sampler_graphs
        return True

    def capture_prefill_graphs(self, max_tokens: int) -> bool:
        """Capture the prefill step for padded token counts up to `max_tokens` (CUDA,
        graph-safe backend), checked against the eager forward (prefill_graphs.py). A capture
        or a check that fails leaves prefill steps eager, with a warning: False."""
        try:
            with torch.inference_mode():
                graphs = capture_prefill(self.model, self.kv_cache, max_tokens, self.null_block_id)
        except Exception as e:  # whatever broke the capture, eager steps still serve
            _LOG.warning(
                "CUDA graphs of the prefill step off, prefill steps run eagerly: %s: %s",
                type(e).__name__,
                e,
            )
            return False
        self.prefill_graphs = graphs
        sizes = graph_batch_sizes(graphs.inputs.max_seqs)  # 1 2 4 8 16
        self.prefill_sampler_graphs = SamplerGraphs(self.sampler, graphs.logits, sizes)
        return True

    def warm_up(self, max_prefill_tokens: int | None, *, full_width: bool) -> None:
        """The most memory a step can take: a prefill of `max_prefill_tokens` (if given) and
        a decode step at the largest batch (padded rows; over the block tables' full width
        when `full_width`, as graphs run), each sampled with the costliest settings."""
        vocab_size = self.vocab_size
        # logit_bias beside logprobs: the sampler then biases a copy of the logits ([B, V] more)
        costly = SamplingParams(
            temperature=0.7,
            top_k=50,
            top_p=0.9,
            min_p=0.01,
            repetition_penalty=1.1,
            logprobs=20,
            logit_bias=((0, 1.0),),
        )
        with torch.inference_mode():
            if max_prefill_tokens:
                table = list(range(blocks_needed(max_prefill_tokens, self.block_size)))
                prompt = [0] * max_prefill_tokens
                # with the costliest prompt logprobs too: every position, top 20
                ask = PromptLogprobsAsk(0, chunk_targets(prompt, 0, len(prompt)), 20)
                out = self.prefill_step([prompt], [table], [0], prompt_logprobs=[ask])
                self.sample(out.logits, [SequenceSampling(costly, [0], vocab_size)]).result()
                out.prompt_logprobs[0].result()
            rows = self.inputs.max_rows
            self.inputs.fill([], rows)
            batch = self.inputs.batch(rows, None if full_width else 1)
            logits = self.model.decode(batch, self.kv_cache)
            seqs = [SequenceSampling(costly, [0], vocab_size, [1]) for _ in range(rows)]
            self.sample(logits, seqs).result()
