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

With `overlap` (--overlap-steps: DecodeConfig.overlap_steps, on CUDA by default), step 3
launches step n+1 before it waits for step n's ids: the rows step n ran feed its sampled ids
on the device (ModelRunner.decode's `ahead`), so the host's work between two steps
(appending, events, staging the next inputs, launching) runs while the device computes
instead of between its steps. What that costs: a request step n's token stops has already
been put in step n+1, whose token for it is discarded; a request step n's token ends by
length is left out of step n+1. A step whose rows need step n's tokens on the host first
(penalties, a constraint's mask) waits for them, as without overlap.

Blocks are freed (`RequestTable.finish`) before a request's last event is handed over, so a
caller that reads its last token and then asks Info sees the blocks back; and only once no
step in flight still writes the request's KV (with overlap, that is one step later).

Nothing here waits for the event loop and nothing on the event loop waits for this thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import torch
from opentelemetry import trace
from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry

from mili.engine.constraint.compiler import ConstraintCompiler
from mili.engine.constraint.mask import BatchMasker
from mili.engine.constraint.matcher import ConstraintError
from mili.engine.logprobs import TokenLogprobs
from mili.engine.step.pinned import StagingRing, pinned_empty, thread_stream
from mili.engine.step.runner import Launched, ModelRunner, use_device
from mili.engine.step.sampler import PendingSample
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


@dataclass(eq=False)
class _Running:
    """A request in the batch and its engine sequence (block_table: the request's)."""

    request: DecodeRequest
    seq: Sequence
    outlet: Outlet  # where its events go (kept here: its call may end before it leaves)
    # The newest launched step it is in whose ids are not in yet: until that step is done its
    # blocks stay taken (the step writes its KV), even once the request has ended.
    step: _Step | None = None
    is_done: bool = False  # ended: its rows in steps still in flight are discarded


@dataclass(eq=False)
class _Step:
    """A launched decode step, until its ids are appended."""

    running: list[_Running]  # its rows, in order
    sample: PendingSample
    started: float  # perf_counter() at launch
    span: Span | None
    # Requests that ended while the step was in flight, with the tokens whose KV they hold
    # and their last event (None: the caller is gone): released once the step is done.
    releases: list[tuple[_Running, list[int], TokenEvent | BaseException | None]] = field(
        default_factory=list
    )


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
        overlap: bool = False,
    ) -> None:
        self._runner = runner
        # Launch each step before the previous one's ids reach the host (see `_advance`).
        self._overlap = overlap
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
        self._steps: list[_Step] = []  # batch thread only: launched, ids not in yet; oldest first
        self._collected_at = 0.0  # batch thread only: perf_counter() of the last step's ids
        self._thread = threading.Thread(target=self._run, name="decode-batcher", daemon=True)
        # Observability (written by the batch thread, read anywhere).
        self.num_steps = 0
        self.num_steps_ahead = 0  # launched before the previous step's ids were in
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
                    while not (self._inbox or self._running or self._steps or self._is_stopping):
                        self._cond.wait()
                    if self._is_stopping:
                        return
                out: list[Delivery] = []
                self._take_joins(out)
                self._drop_cancelled()
                self._advance(out)
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
                self._end(running, running.seq.written_token_ids(), None, [])
            else:
                kept.append(running)
        self._running = kept

    def _advance(self, out: list[Delivery]) -> None:
        """Take the step in flight's tokens and launch the next step, the next one first when
        the steps overlap (the device then never waits for this thread's work between them).
        Every launched step stays in `self._steps` until collected, so that if this thread
        dies, `_fail_all` still waits for each before their requests' blocks go back."""
        if self._steps:
            done = self._steps[0]
            if self._overlap:
                self._launch_ahead(done, out)
            self._collect(done, out)
        if not self._steps and self._running:
            launched = self._launch(list(self._running), None, out)
            if launched is not None and not self._overlap:
                self._take_joins(out)  # while the device computes: they run from the next step
                self._collect(launched, out)

    def _launch_ahead(self, done: _Step, out: list[Delivery]) -> None:
        """Launch the next step over the running requests before `done`'s ids reach the host,
        unless a request in `done` needs its token on the host first (penalties, a constraint:
        any constrained row, since the masker has one buffer, which `done`'s mask copy may
        still read). A request `done`'s token ends by length is left out."""
        if any(r.seq.matcher is not None for r in done.running):
            return
        in_done = {id(r) for r in done.running}
        batch = []
        for r in self._running:
            if id(r) in in_done:
                if r.seq.params.has_penalties:
                    return
                if r.seq.is_length_bound(1):
                    continue
            batch.append(r)
        if batch:
            self._launch(batch, done, out)

    def _launch(
        self, batch: list[_Running], ahead: _Step | None, out: list[Delivery]
    ) -> _Step | None:
        """Launch one decode step of `batch` (with `ahead`: see ModelRunner.decode) and add
        it to `self._steps`; None when it failed, which fails its requests."""
        seqs = [r.seq for r in batch]
        self.num_steps += 1
        self.max_batch_size = max(self.max_batch_size, len(seqs))
        span = _start_step_span([r.outlet for r in batch], self.num_steps)
        started = time.perf_counter()
        try:
            # The masks of the constrained rows, filled on the masker's thread while the
            # forward runs (None: no constrained row, no thread hop, no mask tensor).
            masks = None
            if self._masker is not None:
                masks = self._masker.start([s.matcher for s in seqs])
            previous = None
            if ahead is not None:
                previous = Launched([r.seq for r in ahead.running], ahead.sample)
            sample = self._runner.decode(seqs, masks, ahead=previous)
        except Exception as e:
            self._fail_step(batch, e, span, out)
            return None
        self.num_steps_ahead += ahead is not None
        step = _Step(batch, sample, started, span)
        for r in batch:
            r.step = step
        self._steps.append(step)
        return step

    def _collect(self, step: _Step, out: list[Delivery]) -> None:
        """Wait for `step` (the oldest in flight)'s ids and append them: each request that
        stops ends; then release what ended while the step was in flight (it wrote their KV
        until now)."""
        try:
            result = step.sample.result()
        except Exception as e:
            for r in step.running:
                if r.step is step:
                    r.step = None
            self._fail_step([r for r in step.running if not r.is_done], e, step.span, out)
            self._release(step, out)
            self._steps.remove(step)
            return
        now = time.perf_counter()
        self._metrics.record_step(now - max(step.started, self._collected_at), len(step.running))
        self._collected_at = now
        for r in step.running:
            if r.step is step:
                r.step = None
        ended = set()
        for i, r in enumerate(step.running):
            if r.is_done:  # ended while this step was in flight: its token is discarded
                continue
            token_id = result.token_ids[i]
            try:
                reason = r.seq.append(token_id)
            except ConstraintError as e:  # this request alone fails (its grammar's error)
                _LOG.error("request %s: %s", r.request.name, e)
                self._end(r, r.seq.written_token_ids(), e, out)
                ended.add(id(r))
                continue
            logprobs = None
            if r.request.params.logprobs is not None and result.logprobs is not None:
                top = result.top_logprobs[i] if result.top_logprobs is not None else []
                logprobs = [TokenLogprobs(result.logprobs[i], top)]
            event = TokenEvent([token_id], logprobs, reason)
            if reason:
                self._end(r, r.seq.written_token_ids(), event, out)
                ended.add(id(r))
            else:
                out.append((r.outlet.stream, event))
        if ended:
            self._running = [r for r in self._running if id(r) not in ended]
        if step.span is not None:
            step.span.end()
        self._release(step, out)
        self._steps.remove(step)

    def _end(
        self,
        r: _Running,
        written_token_ids: list[int],
        last: TokenEvent | BaseException | None,
        out: list[Delivery],
    ) -> None:
        """`r` leaves the batch: its blocks go back and its `last` event (None: the caller is
        gone) goes out, at once, or when the step in flight that still writes its KV is done
        (blocks back before the last event, so a caller that reads it sees them free)."""
        r.is_done = True
        if r.step is not None:
            r.step.releases.append((r, written_token_ids, last))
            return
        self._table.finish(r.request, written_token_ids)
        if last is not None:
            out.append((r.outlet.stream, last))

    def _release(self, step: _Step, out: list[Delivery]) -> None:
        releases, step.releases = step.releases, []
        for r, written_token_ids, last in releases:
            self._table.finish(r.request, written_token_ids)
            if last is not None:
                out.append((r.outlet.stream, last))

    def _fail_step(
        self, batch: list[_Running], error: Exception, span: Span | None, out: list[Delivery]
    ) -> None:
        """A step failed: every request in it fails with `error`; the others go on."""
        if span is not None:
            span.record_exception(error)
            span.end()
        _LOG.error("decode step over %d sequences failed", len(batch), exc_info=error)
        failed = {id(r) for r in batch}
        for r in batch:
            self._end(r, [], error, out)
        self._running = [r for r in self._running if id(r) not in failed]

    def _fail_all(self, error: BaseException) -> None:
        out: list[Delivery] = []
        steps, self._steps = self._steps, []
        for step in steps:  # oldest first: each done before its requests' blocks go back
            try:
                step.sample.result()
            except Exception as e:  # its requests fail below anyway
                if step.span is not None:
                    step.span.record_exception(e)
            if step.span is not None:
                step.span.end()
            for r in step.running:
                if r.step is step:
                    r.step = None
            self._release(step, out)
        with self._cond:
            joins, self._inbox = self._inbox, []
        ended = [(r.request, r.outlet) for r in self._running if not r.is_done]
        ended += [(j.request, j.outlet) for j in joins]
        self._running = []
        for request, outlet in ended:
            self._table.finish(request)
            out.append((outlet.stream, error))
        deliver_threadsafe(out)


def _mask_threads() -> int:
    """llguidance threads filling a step's masks: half the cores, 1 to 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))
