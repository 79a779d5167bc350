"""The thread that owns the model and the KV cache: runs steps, ships KV, samples.

    event loop (servicer)                     worker thread
    ─────────────────────                     ─────────────
    submit(task, sink) ─┐                     loop:
    remove(request_id) ─┼─ lock ─ Scheduler ─▶  step = schedule()       (admits, allocates)
                        │                       runner.prefill_step(step, layer_callback=...)
                        │                         after layer i: gather each chunk's blocks
                        │                         ──▶ sink.send_blocks(i, ...)   (host sinks)
                        │                         (no host sink: no callback, and on CUDA
                        │                         the forward is a graph's replay)
                        │                       after the forward: all layers at once
                        │                         ──▶ sink.send_blocks(0, ...)   (cuda-ipc)
                        │                       sample first tokens of finished prompts
                        │                       (masked by their constraints, filled on the
                        │                       masker's thread during the forward)
                        │                       (and prompt logprobs of chunks that ask)
                        └────────────────────── complete(step); sink.finish(first)

The lock guards only bookkeeping (microseconds), never a forward, so the event loop's calls
into `submit` and `remove` do not wait on compute. Blocks are freed only by `remove` (the
transfer ended: acknowledged, failed or cancelled) or when a step fails.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import NamedTuple

import torch
from opentelemetry import trace
from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry

from mili.engine.constraint.mask import BatchMasker
from mili.engine.constraint.matcher import ConstraintMatcher
from mili.engine.kv.prefix_cache import PrefixCacheReading
from mili.engine.logprobs import TokenLogprobs
from mili.engine.model.kv_cache import KVCache
from mili.engine.step.device import use_device
from mili.engine.step.pinned import StagingRing, pinned_empty, thread_stream
from mili.engine.step.prompt_logprobs import PromptLogprobsAsk, chunk_targets
from mili.engine.step.runner import ModelRunner
from mili.engine.step.sampler import SequenceSampling
from mili.engine.stop import stop_token_set
from mili.errors import Unavailable
from mili.plural import plural
from mili.telemetry.metrics import PrefillMetrics
from mili.telemetry.tracing import start_batch_span
from mili.watchdog import Progress
from services.prefill.scheduler import ScheduledChunk, Scheduler, Step
from services.prefill.task import FirstToken, KvSink, PrefillTask

_LOG = logging.getLogger("mili.prefill")
_TRACER = trace.get_tracer("mili.prefill")  # a no-op until tracing installs a provider
# Pinned host memory for the device -> host copies of layers bound for decode over grpc (GPU
# only): a 0.6B model's 512-token prompt is 58.7 MB of KV, an 8B model's 36 layers of 2048
# tokens 302 MB; past this, copies come from torch's caching host allocator as before.
_STAGING_BYTES = 256 << 20
_HISTORY = 1024  # steps kept in `steps`
# Most bytes one gather of the hand-over copies out (a prompt chunk's blocks of a run of
# layers); cuda-ipc takes all layers after the forward, in runs of this size.
_MAX_GATHER_BYTES = 64 << 20


class StepRecord(NamedTuple):
    """What one forward ran, kept for tests and debugging (times are time.perf_counter())."""

    chunks: tuple[tuple[str, int, int], ...]  # (request_id, start, end) per chunk, packed order
    started_at: float
    layer_done_at: list[float]  # when each layer's K/V was in the cache and handed off


@dataclass
class _Job:
    task: PrefillTask
    sink: KvSink
    accepted_at: float
    first_forward_at: float | None = None
    # Set under the lock by `remove`; read without it by the layer callback, where a stale
    # False only means one more gather whose result the closed sink drops.
    is_removed: bool = False
    # SamplingParams.prompt_logprobs set: those of the chunks computed so far, in order.
    prompt_logprobs: list[TokenLogprobs] | None = None


class PrefillWorker:
    """Runs the scheduler's steps on `runner` in one thread; see the module docstring."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        *,
        metrics: PrefillMetrics | None = None,
        masker: BatchMasker | None = None,
        eos_token_ids: Collection[int] = (),
    ) -> None:
        """`masker`: fills constrained first tokens' masks (None: no constrained task comes).
        `eos_token_ids`: the model's (the first token's stop set, as decode's Sequence)."""
        if scheduler.pool.num_ids != runner.kv_cache.num_blocks:
            raise ValueError("scheduler pool and KV cache differ in size")
        self.runner = runner
        self._eos_token_ids = tuple(eos_token_ids)
        device = runner.kv_cache.device
        # pinned host memory for hand-overs to the host (None on the CPU, where none is copied)
        self.staging = StagingRing(_STAGING_BYTES, device) if device.type == "cuda" else None
        self._scheduler = scheduler
        self._masker = masker
        self._metrics = PrefillMetrics(CollectorRegistry()) if metrics is None else metrics
        self._cond = threading.Condition()
        self._jobs: dict[str, _Job] = {}
        self._is_stopping = False
        self._tokens_per_s = 0.0  # moving average, for RESOURCE_EXHAUSTED's retry hint
        self._on_death: Callable[[BaseException], None] | None = None
        self.death: BaseException | None = None  # what killed the worker thread (a bug)
        self.steps: deque[StepRecord] = deque(maxlen=_HISTORY)
        self.progress = Progress()  # read by the service's watchdog
        self._thread = threading.Thread(target=self._run, name="prefill-worker", daemon=True)

    # ---- called from the event loop ----------------------------------------------------------

    def start(self, on_death: Callable[[BaseException], None] | None = None) -> None:
        """Run the worker thread. `on_death`: called on it, with the error, if a bug kills it
        (every prompt then failed UNAVAILABLE): the instance cannot serve any more."""
        self._on_death = on_death
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the running step, fail every prompt left, and join the thread (blocking)."""
        self._stop_taking(Unavailable("prefill instance is shutting down; retry elsewhere"))
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _stop_taking(self, error: BaseException) -> None:
        """Refuse new prompts and fail every prompt here with `error`."""
        with self._cond:
            self._is_stopping = True
            jobs = list(self._jobs.values())
            for job in jobs:
                self._forget(job.task.request_id)
            self._cond.notify_all()
        for job in jobs:
            job.sink.fail(error)

    def reserve(self, task: PrefillTask) -> None:
        """Hold queue room for `task` (Scheduler.reserve): ResourceExhausted for a full queue,
        InvalidArgument for a request id already here, nothing held then. Once it returns,
        `submit` cannot refuse the prompt for room; `remove` gives the room back."""
        with self._cond:
            if self._is_stopping:
                raise Unavailable("prefill instance is shutting down; retry elsewhere")
            self._scheduler.reserve(
                task.request_id, len(task.prompt_token_ids), retry_after_s=self._retry_after_s()
            )

    def submit(self, task: PrefillTask, sink: KvSink) -> None:
        """Queue a prompt, into the room `reserve` held for it (without a reservation:
        ResourceExhausted when the queue is full, nothing queued)."""
        with self._cond:
            if self._is_stopping:
                raise Unavailable("prefill instance is shutting down; retry elsewhere")
            # Prompt logprobs need every position's logits, and a position served from the
            # prefix cache has none: such a prompt computes all of them (no cache lookup; its
            # blocks still join the cache for later prompts).
            wants_logprobs = task.sampling.prompt_logprobs is not None
            self._scheduler.add(
                task.request_id,
                len(task.prompt_token_ids),
                prompt_token_ids=task.prompt_token_ids,
                retry_after_s=self._retry_after_s(),
                reuse_cached=not wants_logprobs,
            )
            job = _Job(task, sink, accepted_at=time.perf_counter())
            job.prompt_logprobs = [] if wants_logprobs else None
            self._jobs[task.request_id] = job
            self._cond.notify()

    def remove(self, request_id: str) -> None:
        """The request ended (any way): stop computing it and free its blocks (or the room it
        reserved). Idempotent."""
        with self._cond:
            if self._forget(request_id):
                self._cond.notify()  # freed blocks may admit a waiting prompt

    @property
    def kv_cache(self) -> KVCache:
        return self.runner.kv_cache

    @property
    def num_queued_tokens(self) -> int:
        with self._cond:
            return self._scheduler.num_queued_tokens

    @property
    def num_queued_requests(self) -> int:
        """Prompts submitted and not removed yet: waiting, computing or transferring."""
        with self._cond:
            return len(self._jobs)

    @property
    def num_waiting_requests(self) -> int:
        """Prompts not admitted to a step yet (they hold no blocks)."""
        with self._cond:
            return self._scheduler.num_waiting

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new prompt can get: free ones and cached ones no request holds."""
        with self._cond:
            return self._scheduler.prefix_cache.num_available

    def prefix_cache_reading(self) -> PrefixCacheReading:
        with self._cond:
            return self._scheduler.prefix_cache.reading()

    @property
    def num_total_blocks(self) -> int:
        return self._scheduler.pool.num_blocks

    # ---- the thread --------------------------------------------------------------------------

    def _forget(self, request_id: str) -> bool:
        job = self._jobs.pop(request_id, None)
        if job is not None:
            job.is_removed = True
        return self._scheduler.remove(request_id)

    def _retry_after_s(self) -> float:
        if self._tokens_per_s <= 0:
            return 1.0
        return min(60.0, max(0.05, self._scheduler.num_queued_tokens / self._tokens_per_s))

    def _sampling(self, task: PrefillTask, vocab_size: int) -> SequenceSampling:
        """The first token's sampling state; its stop set (min_tokens holds it back) is the one
        decode's Sequence gets."""
        params = task.sampling
        stops = stop_token_set(
            params.stop_token_ids, self._eos_token_ids, ignore_eos=params.ignore_eos
        )
        return SequenceSampling(params, task.prompt_token_ids, vocab_size, stop_token_ids=stops)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:
            self.death = e
            self._stop_taking(Unavailable("prefill instance failed; retry elsewhere"))
            if self._on_death is not None:
                self._on_death(e)
            raise

    def _loop(self) -> None:
        use_device(self.kv_cache.device)
        while True:
            with self._cond:
                step = None
                while not self._is_stopping and (step := self._scheduler.schedule()) is None:
                    self.progress.idle()
                    self._cond.wait()
                if step is None:
                    return
                jobs = [self._jobs[chunk.request_id] for chunk in step.chunks]
            self.progress.busy(f"a prefill step of {plural(step.num_tokens, 'token')}")
            started = time.perf_counter()
            span = self._start_span(step, jobs)
            try:
                firsts = self._execute(step, jobs)
            except Exception as exc:  # a bug or OOM: fail this step's prompts, keep serving
                if span is not None:
                    span.record_exception(exc)
                    span.end()
                _LOG.exception("prefill step of %s failed", plural(step.num_tokens, "token"))
                with self._cond:
                    for job in jobs:
                        # Not a newer request that took a removed one's id meanwhile.
                        if self._jobs.get(job.task.request_id) is job:
                            self._forget(job.task.request_id)
                for job in jobs:
                    job.sink.fail(exc)
                continue
            elapsed = time.perf_counter() - started
            if span is not None:
                span.end()
            self._metrics.record_step(elapsed, len(step.chunks), step.num_tokens)
            with self._cond:
                self._scheduler.complete(step)
                rate = step.num_tokens / max(elapsed, 1e-6)
                self._tokens_per_s = (
                    rate if not self._tokens_per_s else (0.8 * self._tokens_per_s + 0.2 * rate)
                )
            for job, first in firsts:
                job.sink.finish(first)

    def _start_span(self, step: Step, jobs: list[_Job]) -> Span | None:
        """The step's span, linked to each traced prompt's request; None when none is traced
        (tracing off: no span work at all)."""
        contexts = [job.task.span_context for job in jobs if job.task.span_context is not None]
        if not contexts:
            return None
        attributes = {"mili.batch_size": len(step.chunks), "mili.num_tokens": step.num_tokens}
        return start_batch_span(_TRACER, "prefill step", contexts, attributes)

    def _execute(self, step: Step, jobs: list[_Job]) -> list[tuple[_Job, FirstToken]]:
        runner = self.runner
        block_size = runner.block_size
        started = time.perf_counter()
        for job in jobs:
            if job.first_forward_at is None:
                job.first_forward_at = started
        # Ship-only chunks (wholly in a cached prefix) have nothing to compute: they are not
        # rows of the batch, only shipped by `on_layer`.
        computed = [i for i, c in enumerate(step.chunks) if c.num_compute_tokens > 0]
        record = StepRecord(tuple((c.request_id, c.start, c.end) for c in step.chunks), started, [])
        self.steps.append(record)

        # Per chunk: (first prompt block it ships, the blocks' index on the cache's device),
        # made once for every layer; None: nothing to ship.
        shipments = [
            self._shipment(chunk, block_size, job.task.num_cached_blocks)
            for chunk, job in zip(step.chunks, jobs, strict=True)
        ]

        cache = self.kv_cache

        def ship(start: int, stop: int, device_sinks: bool) -> None:
            """Hand layers start .. stop-1 of each chunk's blocks to the sinks that take them
            on the device (True) or on the host (False)."""
            for shipment, job in zip(shipments, jobs, strict=True):
                sink = job.sink
                if shipment is None or job.is_removed or sink.takes_device_tensors != device_sinks:
                    continue
                first, index = shipment
                for a, b in _layer_groups(start, stop, index.numel() * cache.layer_block_bytes):
                    kv, ready = hand_over(
                        cache.gather_layers(a, b, index), device_sinks, self.staging
                    )
                    sink.send_blocks(a, first, kv, ready)

        def on_layer(layer: int) -> None:
            ship(layer, layer + 1, device_sinks=False)  # host copies overlap the next layers
            record.layer_done_at.append(time.perf_counter())

        # Only a host sink takes layers as they are computed; without one the forward runs
        # whole (a CUDA graph's replay, where the runner holds one: prefill_graphs.py).
        takes_layers = any(
            shipment is not None and not job.sink.takes_device_tensors
            for shipment, job in zip(shipments, jobs, strict=True)
        )

        asks = [  # row of the batch -> the prompt logprobs its chunk computes
            PromptLogprobsAsk(row, chunk_targets(task.prompt_token_ids, c.start, c.end), n)
            for row, i in enumerate(computed)
            for c, task in [(step.chunks[i], jobs[i].task)]
            if (n := task.sampling.prompt_logprobs) is not None
        ]
        # Prompts this step finishes sample their first token: their masks (a fresh matcher
        # each, in its start state) are filled on the masker's thread during the forward.
        last_rows = [row for row, i in enumerate(computed) if step.chunks[i].is_last]
        matchers = [_matcher(jobs[computed[row]].task) for row in last_rows]
        masks = None if self._masker is None else self._masker.start(matchers)
        output = runner.prefill_step(
            [
                jobs[i].task.prompt_token_ids[step.chunks[i].start : step.chunks[i].end]
                for i in computed
            ],
            [step.chunks[i].block_table for i in computed],
            [step.chunks[i].start for i in computed],
            prompt_logprobs=asks,
            layer_callback=on_layer if takes_layers else None,
        )
        # Device to device (cuda-ipc) every layer at once, behind the forward on its stream:
        # the copies take microseconds; per layer, their host work took most of a step.
        ship(0, cache.num_layers, device_sinks=True)
        logits = output.logits  # [len(computed), vocab] float32
        for ask, pending in zip(asks, output.prompt_logprobs, strict=True):
            job = jobs[computed[ask.row]]
            if job.prompt_logprobs is not None:  # waits for the device: only asking steps do
                job.prompt_logprobs.extend(pending.result())
        mask = None if masks is None else masks.result()
        if not last_rows:
            return []
        # Every finishing row is sampled (the mask's rows are these), removed ones dropped after.
        finished = [jobs[computed[row]] for row in last_rows]
        vocab_size = runner.vocab_size  # the tokenizer's
        seqs = [self._sampling(j.task, vocab_size) for j in finished]
        # All rows finishing: the logits as they are (a prefill graph's static rows, whose
        # sampling can replay a graph too), else a gather of the finishing ones.
        finishing = logits if last_rows == list(range(logits.shape[0])) else logits[last_rows]
        out = runner.sample(finishing, seqs, mask).result()
        done_at = time.perf_counter()
        results = []
        for i, job in enumerate(finished):
            assert job.first_forward_at is not None
            if job.is_removed:
                continue
            matcher = matchers[i]
            if matcher is not None and not matcher.accept(out.token_ids[i]):
                # the mask allowed it: a grammar engine error; this prompt alone fails
                job.sink.fail(matcher.refusal(out.token_ids[i], "first token"))
                continue
            first = FirstToken(
                token_id=out.token_ids[i],
                logprob=None if out.logprobs is None else out.logprobs[i],
                top_logprobs=None if out.top_logprobs is None else out.top_logprobs[i],
                queue_ms=(job.first_forward_at - job.accepted_at) * 1e3,
                compute_ms=(done_at - job.first_forward_at) * 1e3,
                batch_size=len(computed),
                num_cached_tokens=step.chunks[computed[last_rows[i]]].num_cached_tokens,
                prompt_logprobs=job.prompt_logprobs,
            )
            results.append((job, first))
        return results

    def _shipment(
        self, chunk: ScheduledChunk, block_size: int, num_skipped: int
    ) -> tuple[int, torch.Tensor] | None:
        """The blocks `chunk` completes, except the first `num_skipped` of the prompt (decode
        holds them already): (first of them, their index on the cache's device), or None."""
        first, last = chunk.block_range(block_size)
        first = max(first, num_skipped)
        if first >= last:
            return None
        return first, self.kv_cache.block_index(chunk.block_table[first:last])


def _matcher(task: PrefillTask) -> ConstraintMatcher | None:
    """A fresh matcher of the task's constraint (its start state), or None."""
    return None if task.constraint is None else task.constraint.matcher()


def _layer_groups(start: int, stop: int, bytes_per_layer: int) -> list[tuple[int, int]]:
    """Layers start .. stop-1 in runs of at most _MAX_GATHER_BYTES each (at least one layer):
    what one gather copies out at once stays bounded, whatever the prompt chunk's length."""
    per_group = max(1, _MAX_GATHER_BYTES // max(1, bytes_per_layer))
    return [(a, min(a + per_group, stop)) for a in range(start, stop, per_group)]


def hand_over(
    kv: torch.Tensor, takes_device_tensors: bool, staging: StagingRing | None = None
) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """Gathered blocks (kv: [num_layers, 2, n, block_size, kv_heads, D]) as a KvSink takes
    them, with the `ready` wait its encoder thread calls first; never waits for the GPU here.
    On a GPU, for the host: a pinned copy from `staging`, or from torch's caching host
    allocator where it has no room (or none is given)."""
    if kv.device.type == "cuda" and takes_device_tensors:
        # cuda-ipc: the sender copies device to device on its own stream once the gather
        # (queued on ours) is over.
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(kv.device))
        return kv, event.synchronize
    if kv.device.type == "cuda":
        # Copy to pinned host memory on a side stream, without waiting for the GPU: the model's
        # stream goes on to layer i+1 while the copy engine drains this one, the sender's
        # encoder thread waits on the event.
        stream = thread_stream(kv.device)
        stream.wait_stream(torch.cuda.current_stream(kv.device))  # the gather is queued there
        # A span of `staging` comes round again only behind the copy into it before this one,
        # on the same side stream (the worker's thread_stream): stream order keeps them apart.
        host = pinned_empty(kv.shape, kv.dtype, staging)
        with torch.cuda.stream(stream):
            host.copy_(kv, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        # kv belongs to the model's stream: its memory must not go to a later kernel there
        # before this copy has read it.
        kv.record_stream(stream)
        return host, event.synchronize
    if kv.device.type != "cpu":
        return kv.cpu(), None
    return kv, None
