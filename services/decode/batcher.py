"""Continuous batching: one thread owns the model, the KV cache tensors and the sampler.

Every iteration of the loop:

    1. take the requests whose KV landed since the last step (`join`): stream their first
       token (prefill's), and add those that did not already stop to the running batch;
    2. drop requests cancelled since the last step (caller gone, deadline) and free their blocks;
    3. one decode step over all running sequences (ModelRunner.decode: static inputs, a CUDA
       graph or an eager forward, sampling on the device, the ids' copy back queued); the
       constrained rows' token masks are filled on the masker's thread meanwhile (started
       before the forward; none at all when no row is constrained) and applied before
       sampling; while the device computes, take the requests that joined meanwhile (they run
       from the next step); then wait for the ids, append them (each constrained row's matcher
       accepts its token: a finished grammar stops, a refused token fails that request
       alone), finish the ones that stop;
    4. hand the step's events to the event loop (`deliver_threadsafe`, one wake-up per step).

Blocks are freed (`RequestTable.finish`) before a request's last event is handed over, so a
caller that reads its last token and then asks Info sees the blocks back.

Nothing here waits for the event loop and nothing on the event loop waits for this thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
from opentelemetry import trace
from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry

from mili.engine.constraint.compiler import ConstraintCompiler
from mili.engine.constraint.mask import BatchMasker
from mili.engine.constraint.matcher import ConstraintError
from mili.engine.logprobs import TokenLogprobs
from mili.engine.step.pinned import StagingRing, pinned_empty, thread_stream
from mili.engine.step.runner import ModelRunner, use_device
from mili.engine.step.sequence import Sequence
from mili.errors import FailedPrecondition, Unavailable
from mili.kv_handoff import block_rows
from mili.telemetry.metrics import DecodeMetrics
from mili.telemetry.tracing import start_batch_span
from services.decode.requests import DecodeRequest, RequestTable
from services.decode.stream import Delivery, Outlet, TokenEvent, deliver_threadsafe

_LOG = logging.getLogger("mili.decode")
_TRACER = trace.get_tracer("mili.decode")  # a no-op until tracing installs a provider
# Pinned host memory for grpc chunks landing on a GPU: each landing thread stages one chunk (a
# layer of at most a prefill step's tokens) at a time, and a transfer holds at most 16 MiB of
# chunks (transfer.py's _MAX_LANDING_BYTES); larger ones use torch's caching host allocator.
_STAGING_BYTES = 64 << 20


def _start_step_span(outlets: list[Outlet], step: int) -> Span | None:
    """One span per batched step, linked to the `decode request` span of every traced request
    in it (a step serves many requests: none of them is its parent). None when none is traced,
    so with tracing off a step costs one scan of the batch and no span."""
    contexts = [o.span_context for o in outlets if o.span_context is not None]
    if not contexts:
        return None
    attributes = {"mili.decode.step": step, "mili.batch_size": len(outlets)}
    return start_batch_span(_TRACER, "decode step", contexts, attributes)


@dataclass(frozen=True)
class _Join:
    request: DecodeRequest
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    outlet: Outlet


class _Running(NamedTuple):
    """A request in the batch and its engine sequence (block_table: the request's)."""

    request: DecodeRequest
    seq: Sequence
    outlet: Outlet  # where its events go (kept here: its call may end before it leaves)


class Batcher:
    """The decode loop thread. `join` and `scatter` may be called from any thread."""

    def __init__(
        self,
        runner: ModelRunner,
        table: RequestTable,
        *,
        eos_token_ids: frozenset[int],
        max_context_tokens: int,
        metrics: DecodeMetrics | None = None,
        constraints: ConstraintCompiler | None = None,
    ) -> None:
        self._runner = runner
        # Fills constrained rows' token masks (None: no compiler, so no constrained request).
        self._masker = None
        if constraints is not None:
            max_batch = runner.batch_sizes[-1]
            self._masker = BatchMasker(constraints.tokenizer, max_batch, _mask_threads())
        device = runner.kv_cache.device
        # decode's landing threads stage grpc chunks here on their way to the GPU
        self._staging = StagingRing(_STAGING_BYTES, device) if device.type == "cuda" else None
        self._table = table
        self._eos_token_ids = eos_token_ids
        self._max_context_tokens = max_context_tokens
        self._metrics = DecodeMetrics(CollectorRegistry()) if metrics is None else metrics
        self._cond = threading.Condition()
        self._inbox: list[_Join] = []  # guarded by _cond
        self._is_stopping = False  # guarded by _cond
        self._running: list[_Running] = []  # batch thread only
        self._thread = threading.Thread(target=self._run, name="decode-batcher", daemon=True)
        # Observability (written by the batch thread, read anywhere).
        self.num_steps = 0
        self.max_batch_size = 0

    # ---- any thread ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the current step, fail what is left (UNAVAILABLE), free its blocks, join."""
        with self._cond:
            self._is_stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def join(
        self,
        request: DecodeRequest,
        first_token_id: int,
        first_logprobs: TokenLogprobs | None,
        outlet: Outlet,
    ) -> None:
        """Add a RUNNING request (its KV is in the cache) to the batch from the next step on;
        its events go to `outlet`."""
        with self._cond:
            if self._is_stopping:
                raise Unavailable("decode instance is shutting down")
            self._inbox.append(_Join(request, first_token_id, first_logprobs, outlet))
            self._cond.notify()

    def scatter(self, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write whole prompt blocks of one layer into the cache (k, v: [n, S, KVH, D]).

        Called from a transfer thread while this loop runs: safe because the blocks belong to a
        request that is not in the batch yet, and no step reads or writes them.
        """
        cache = self._runner.kv_cache
        pairs = ((cache.k[layer], k), (cache.v[layer], v))
        if all(block_rows.fits(dst, block_ids, src) for dst, src in pairs):
            for dst, src in pairs:
                block_rows.write_blocks(dst, block_ids, src)
            return
        if cache.device.type == "cuda" and k.device.type == "cpu":
            self._scatter_from_host(layer, block_ids, k, v)
            return
        with torch.inference_mode():
            cache.scatter_blocks(layer, block_ids, k, v)  # input it will refuse

    def _scatter_from_host(
        self, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """CUDA: stage k, v (pageable, [n, S, KVH, D]) in pinned memory (the staging ring's, or
        torch's caching host allocator's where the ring is full) and copy them in on a landing
        stream of this thread's own, then wait for that stream here. The model's stream never
        waits for a landing, and the request joins the batch only after every landing returned
        (the commit waits for them), so its first step reads landed blocks."""
        cache = self._runner.kv_cache
        stream = thread_stream(cache.device)
        with torch.inference_mode(), torch.cuda.stream(stream):
            k_pinned = pinned_empty(k.shape, k.dtype, self._staging).copy_(k)
            v_pinned = pinned_empty(v.shape, v.dtype, self._staging).copy_(v)
            try:
                cache.scatter_blocks(layer, block_ids, k_pinned, v_pinned)
            finally:
                # this landing thread waits; only then may the staging spans be reused
                stream.synchronize()

    # ---- batch thread --------------------------------------------------------------------------

    def _run(self) -> None:
        use_device(self._runner.kv_cache.device)
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._running or self._is_stopping):
                        self._cond.wait()
                    if self._is_stopping:
                        return
                out: list[Delivery] = []
                self._take_joins(out)
                self._drop_cancelled()
                if self._running:
                    self._step(out)
                deliver_threadsafe(out)
        finally:
            with self._cond:  # also when a bug killed the loop: refuse joins from now on
                self._is_stopping = True
            self._fail_all(Unavailable("decode instance is shutting down; retry elsewhere"))

    def _take_joins(self, out: list[Delivery]) -> None:
        """Add the requests that joined since the last look to `self._running`."""
        with self._cond:
            joins, self._inbox = self._inbox, []
        for join in joins:
            self._add(join, out)

    def _add(self, join: _Join, out: list[Delivery]) -> None:
        """Stream prefill's first token; keep the request unless that token already ends it."""
        request = join.request
        params = request.params
        try:
            seq = Sequence.new(
                request.prompt_token_ids,
                params,
                vocab_size=self._runner.vocab_size,
                eos_token_ids=self._eos_token_ids,
                max_context_tokens=self._max_context_tokens,
                # The whole reservation: the runner copies it to the device once, and reads
                # only the blocks under each step's position.
                block_table=request.block_table,
                matcher=request.matcher,
            )
            reason = seq.append(join.first_token_id)
        except ValueError as e:  # validated at the transfer edge; a bug if it happens
            self._table.finish(request)
            out.append((join.outlet.stream, e))
            return
        except ConstraintError as e:  # prefill masked it by the same grammar: they disagree
            self._table.finish(request)
            why = f"prefill's first token does not fit the constraint here: {e}"
            out.append((join.outlet.stream, FailedPrecondition(why)))
            return
        if reason or request.is_cancelled:
            self._table.finish(request, seq.written_token_ids())
        else:
            self._running.append(_Running(request, seq, join.outlet))
        logprobs = None
        if params.logprobs is not None and join.first_logprobs is not None:
            logprobs = [join.first_logprobs]
        out.append((join.outlet.stream, TokenEvent([join.first_token_id], logprobs, reason)))

    def _drop_cancelled(self) -> None:
        kept = []
        for running in self._running:
            if running.request.is_cancelled:
                self._table.finish(running.request, running.seq.written_token_ids())
            else:
                kept.append(running)
        self._running = kept

    def _step(self, out: list[Delivery]) -> None:
        running, self._running = self._running, []  # requests joining meanwhile go here
        seqs = [r.seq for r in running]
        self.num_steps += 1
        self.max_batch_size = max(self.max_batch_size, len(seqs))
        span = _start_step_span([r.outlet for r in running], self.num_steps)
        started = time.perf_counter()
        try:
            # The masks of the constrained rows, filled on the masker's thread while the
            # forward runs (None: no constrained row, no thread hop, no mask tensor).
            masks = None
            if self._masker is not None:
                masks = self._masker.start([s.matcher for s in seqs])
            pending = self._runner.decode(seqs, masks)  # launched; on CUDA the device works on
            self._take_joins(out)  # ...while the host admits the next step's newcomers
            result = pending.result()
            self._metrics.record_step(time.perf_counter() - started, len(seqs))
        except Exception as e:
            if span is not None:
                span.record_exception(e)
                span.end()
            _LOG.exception("decode step over %d sequences failed", len(seqs))
            for r in running:
                self._table.finish(r.request)
                out.append((r.outlet.stream, e))
            return
        kept = []
        for i, (request, seq, outlet) in enumerate(running):
            token_id = result.token_ids[i]
            try:
                reason = seq.append(token_id)
            except ConstraintError as e:  # this request alone fails (its grammar's error)
                _LOG.error("request %s: %s", request.name, e)
                self._table.finish(request, seq.written_token_ids())
                out.append((outlet.stream, e))
                continue
            logprobs = None
            if request.params.logprobs is not None and result.logprobs is not None:
                top = result.top_logprobs[i] if result.top_logprobs is not None else []
                logprobs = [TokenLogprobs(result.logprobs[i], top)]
            if reason:
                self._table.finish(request, seq.written_token_ids())
            else:
                kept.append(running[i])
            out.append((outlet.stream, TokenEvent([token_id], logprobs, reason)))
        self._running = kept + self._running
        if span is not None:
            span.end()

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            joins, self._inbox = self._inbox, []
        ended = [(r.request, r.outlet) for r in self._running]
        ended += [(j.request, j.outlet) for j in joins]
        self._running = []
        out: list[Delivery] = []
        for request, outlet in ended:
            self._table.finish(request)
            out.append((outlet.stream, error))
        deliver_threadsafe(out)


def _mask_threads() -> int:
    """llguidance threads filling a step's masks: half the cores, 1 to 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))
