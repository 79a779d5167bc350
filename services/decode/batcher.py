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
launches step n+1's forward before it waits for step n's ids: the rows step n ran feed its
sampled ids on the device (ModelRunner.decode_logits' `ahead`); then step n's ids are
appended and step n+1's sampling is launched, which reads them (penalties, the constraint
masks, filled now, the seeded draw's position). So the host's work between two forwards
(the ids' read-back, appending, events, masks, staging the next inputs) runs while the
device computes instead of between its steps. What that costs: a request step n's token
stops has already been put in step n+1, whose token for it is discarded; a request step n's
token ends by length is left out of step n+1.

Blocks grow as requests run: admission reserved a request's prompt and first outputs
(blocks_to_reserve); before each step the batch thread `grow`s every table over the position
that step writes. Where the pool is a block short, it preempts the request of the largest
priority value that joined last (as vLLM's recompute preemption), which waits in `Preempted`
(preemption.py) until it resumes, its K/V computed again. With overlap, a step that would need
a block the pool lacks is not launched ahead: the step in flight is collected first, so a
preempted request's blocks go back with no step writing them.

Blocks are freed (`RequestTable.finish`) before a request's last event is handed over, so a
caller that reads its last token and then asks Info sees the blocks back; and only once no
step in flight still writes the request's KV (with overlap, that is one step later).

Nothing here waits for the event loop and nothing on the event loop waits for this thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry

from mili.engine.constraint.compiler import ConstraintCompiler
from mili.engine.constraint.mask import BatchMasker
from mili.engine.constraint.matcher import ConstraintError
from mili.engine.logprobs import TokenLogprobs
from mili.engine.step.device import settle, use_device
from mili.engine.step.runner import Launched, ModelRunner
from mili.errors import MiliError, Unavailable
from mili.plural import plural
from mili.telemetry.metrics import DecodeMetrics
from mili.watchdog import Progress
from services.decode.batch import Join, Running, Step, grow, matchers, start_step_span
from services.decode.preemption import Preempted
from services.decode.requests import DecodeRequest, RequestTable
from services.decode.stream import Delivery, Outlet, TokenEvent, deliver_threadsafe

_LOG = logging.getLogger("mili.decode")
# How often a batch with only preempted requests looks for freed blocks: a lease that expires
# or a transfer that fails frees them without a word to this thread.
RESUME_POLL_S = 0.05


class Batcher:
    """The decode loop thread. `join` may be called from any thread."""

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
            self._masker = BatchMasker(constraints.tokenizer, max_batch, constraints.config.lanes)
        self._table = table
        self._eos_token_ids = eos_token_ids
        self._max_context_tokens = max_context_tokens
        self._metrics = DecodeMetrics(CollectorRegistry()) if metrics is None else metrics
        self._cond = threading.Condition()
        self._inbox: list[Join] = []  # guarded by _cond
        self._is_stopping = False  # guarded by _cond
        self._on_death: Callable[[BaseException], None] | None = None
        self.death: BaseException | None = None  # what killed the batch thread (a bug)
        self._running: list[Running] = []  # batch thread only
        # batch thread only: no running request could step, the blocks being another's to
        # come (see `Preempted.make_room`): the loop waits for a join (or RESUME_POLL_S)
        self._is_waiting_for_room = False
        self._num_joined = 0  # batch thread only
        self._steps: list[Step] = []  # batch thread only: launched, ids not in yet; oldest first
        self._collected_at = 0.0  # batch thread only: perf_counter() of the last step's ids
        self._out: list[Delivery] = []  # batch thread only: this iteration's events so far
        self._thread = threading.Thread(target=self._run, name="decode-batcher", daemon=True)
        # Observability (written by the batch thread, read anywhere).
        self.progress = Progress()  # read by the instance's watchdog
        # batch thread only
        self._preempted = Preempted(runner, table, self._metrics, self.progress)
        self.num_steps = 0
        self.num_steps_ahead = 0  # launched before the previous step's ids were in
        self.max_batch_size = 0

    @property
    def overlap(self) -> bool:
        """Whether steps overlap (`overlap` as given; the instance turns it off when the
        overlapped step's start-up check fails)."""
        return self._overlap

    # ---- any thread ----------------------------------------------------------------------------

    def start(self, on_death: Callable[[BaseException], None] | None = None) -> None:
        """Run the batch thread. `on_death`: called on it, with the error, if a bug kills it
        (every request then failed UNAVAILABLE): the instance cannot serve any more."""
        self._on_death = on_death
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
            self._inbox.append(Join(request, first_token_id, first_logprobs, outlet))
            self._cond.notify()

    # ---- batch thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:
            self.death = e
            if self._on_death is not None:
                self._on_death(e)
            raise

    def _loop(self) -> None:
        use_device(self._runner.kv_cache.device)
        try:
            while True:
                with self._cond:
                    while not (
                        self._inbox
                        or (self._running and not self._is_waiting_for_room)
                        or self._steps
                        or self._is_stopping
                        or self._preempted.is_resuming
                    ):
                        self.progress.idle()
                        if self._preempted or self._is_waiting_for_room:  # look again soon
                            self._cond.wait(RESUME_POLL_S)
                            break
                        self._cond.wait()
                    is_stopping = self._is_stopping
                out = self._out = []  # kept on self: a death mid-iteration still sends it
                if is_stopping:
                    while self._steps:  # their tokens are sampled: hand them out
                        self._collect(self._steps[0], out)
                    return
                self._take_joins()
                self._drop_cancelled()
                self._resume(out)
                self.progress.busy(f"a decode step of {plural(len(self._running), 'request')}")
                self._advance(out)
                deliver_threadsafe(out)
                self._out = []
        finally:
            with self._cond:  # also when a bug killed the loop: refuse joins from now on
                self._is_stopping = True
            self._fail_all(Unavailable("decode instance is shutting down; retry elsewhere"))

    def _take_joins(self) -> None:
        """Add the requests that joined since the last look to `self._running`, and hand out
        prefill's first tokens at once: not after the step that follows (a whole step on
        every request's TTFT), and only those, so later events keep their order."""
        with self._cond:
            joins, self._inbox = self._inbox, []
        out: list[Delivery] = []
        taken = 0
        try:
            for join in joins:
                taken += 1
                self._add(join, out)
        except BaseException as e:  # a bug: this thread dies, and `_fail_all` ends the rest
            broken = joins[taken - 1]  # ends here (finish is idempotent: its blocks go back)
            self._table.finish(broken.request)
            out.append((broken.outlet.stream, e))
            with self._cond:  # the joins not looked at yet, back to where `_fail_all` finds them
                self._inbox[:0] = joins[taken:]
            raise
        finally:
            deliver_threadsafe(out)

    def _add(self, join: Join, out: list[Delivery]) -> None:
        """Stream prefill's first token; keep the request unless that token already ends it."""
        request = join.request
        try:
            seq, event = join.start(
                vocab_size=self._runner.vocab_size,
                eos_token_ids=self._eos_token_ids,
                max_context_tokens=self._max_context_tokens,
            )
        except Exception as e:  # this request alone fails (`Join.start`)
            self._table.finish(request)
            out.append((join.outlet.stream, e))
            return
        if event.finish_reason or request.is_cancelled:
            self._table.finish(request, seq.written_token_ids())
        else:
            self._num_joined += 1
            self._running.append(Running(request, seq, join.outlet, self._num_joined))
        out.append((join.outlet.stream, event))

    def _drop_cancelled(self) -> None:
        kept = []
        for running in self._running:
            if running.request.is_cancelled:
                self._end(running, running.seq.written_token_ids(), None, [])
            else:
                kept.append(running)
        self._running = kept
        for preempted in self._preempted.take_cancelled():
            self._end(preempted, [], None, [])  # it holds no block

    @property
    def num_preemptions(self) -> int:
        return self._preempted.num_preemptions

    def _resume(self, out: list[Delivery]) -> None:
        """Preempted requests that fit again run from the next step."""
        if not self._preempted:  # every iteration: no generator when nothing waits
            return
        for r, error in self._preempted.resume(len(self._running)):
            if error is None:
                self._running.append(r)
            else:
                self._end(r, [], error, out)

    def _is_joining_after(self, r: Running) -> bool:
        """Whether a request that will rank after `r` is about to join: admitted with its KV
        on its way, or joined since this iteration took the joins."""
        priority = r.request.priority
        with self._cond:
            if any(join.request.priority >= priority for join in self._inbox):
                return True
        return self._table.is_joining_at_or_after(priority)

    def _advance(self, out: list[Delivery]) -> None:
        """Take the step in flight's tokens and launch the next step; with overlap the next
        step's forward first (the device then never waits for this thread's work between
        steps). Every launched step stays in `self._steps` until collected, so that if this
        thread dies, `_fail_all` still waits for each before their requests' blocks go back."""
        self._is_waiting_for_room = False
        if self._steps:  # only with overlap: without, a step is collected where it launched
            self._step_ahead(self._steps[0], out)
        if not self._steps and self._running:
            sitting_out = self._preempted.make_room(self._running, self._is_joining_after)
            batch = [r for r in self._running if r not in sitting_out]
            self._is_waiting_for_room = not batch
            if batch:
                step = self._launch(batch, out)
                if step is not None and not self._overlap:
                    self._take_joins()  # while the device computes: they run from the next step
                    self._collect(step, out)

    def _step_ahead(self, done: Step, out: list[Delivery]) -> None:
        """The next step's forward over the running requests, launched before `done`'s ids
        reach the host (a request `done`'s token ends by length is left out); then `done`'s
        ids, appended; then the next step's sampling, which reads them (penalties, masks,
        the seeded draw's position)."""
        in_done = {id(r) for r in done.running}
        batch = [r for r in self._running if not (id(r) in in_done and r.seq.is_length_bound())]
        if not batch or not grow(self._table, batch):  # a block short: make room after it
            self._collect(done, out)
            return
        assert done.sample is not None  # a step without its sampling was aborted
        step = self._begin(batch)
        try:
            ahead = Launched([r.seq for r in done.running], done.sample)
            logits = self._runner.decode_logits([r.seq for r in batch], ahead=ahead)
        except Exception as e:
            self._abort(step, e, out, previous=done)
            self._collect(done, out)
            return
        self.num_steps_ahead += 1
        self._collect(done, out)
        try:
            mask = None
            if self._masker is not None:  # the forward runs meanwhile: no thread hop
                mask = self._masker.fill(matchers(batch))
            step.sample = self._runner.sample(logits, [r.seq.sampling for r in batch], mask)
        except Exception as e:
            self._abort(step, e, out, previous=None)

    def _launch(self, batch: list[Running], out: list[Delivery]) -> Step | None:
        """Launch one decode step of `batch` and its sampling; None when that failed, which
        fails its requests."""
        step = self._begin(batch)
        try:
            # The masks of the constrained rows, filled on the masker's thread while the
            # forward runs (None: no constrained row, no thread hop, no mask tensor).
            masks = None if self._masker is None else self._masker.start(matchers(batch))
            step.sample = self._runner.decode([r.seq for r in batch], masks)
        except Exception as e:
            self._abort(step, e, out, previous=None)
            return None
        return step

    def _begin(self, batch: list[Running]) -> Step:
        """A step of `batch`, in flight from now on (its rows' KV is written from its
        launch until its ids are in)."""
        self.num_steps += 1
        self.max_batch_size = max(self.max_batch_size, len(batch))
        span = start_step_span([r.outlet for r in batch], self.num_steps)
        step = Step(batch, time.perf_counter(), span)
        for r in batch:
            r.step = step
        self._steps.append(step)
        return step

    def _abort(
        self, step: Step, error: Exception, out: list[Delivery], *, previous: Step | None
    ) -> None:
        """Launching `step` failed: wait for what it launched, then fail its requests. Those
        also in `previous` (a step still in flight) wait for it instead."""
        self._steps.remove(step)
        in_previous = set() if previous is None else {id(r) for r in previous.running}
        for r in step.running:
            if r.step is step:
                r.step = previous if id(r) in in_previous else None
        self._settle()  # a forward launched before the failure still writes their KV
        self._fail_step([r for r in step.running if not r.is_done], error, step.span, out)
        self._release(step, out)

    def _settle(self) -> None:
        """Wait until the device has run everything this thread launched (CUDA)."""
        settle(self._runner.kv_cache.device)

    def _collect(self, step: Step, out: list[Delivery]) -> None:
        """Wait for `step` (the oldest in flight)'s ids and append them: each request that
        stops ends; then release what ended while the step was in flight (it wrote their KV
        until now)."""
        assert step.sample is not None  # a step without its sampling was aborted
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
            except (ConstraintError, MiliError) as e:  # this request alone fails
                # (ConstraintError: a bug of the grammar engine's; ResourceExhausted: one of its
                # limits, the client's grammar too complex; InvalidArgument: the grammar at a
                # dead end, e.g. naming an EOS token)
                level = logging.INFO if isinstance(e, MiliError) else logging.ERROR
                _LOG.log(level, "request %s: %s", r.request.name, e)
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
        r: Running,
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

    def _release(self, step: Step, out: list[Delivery]) -> None:
        releases, step.releases = step.releases, []
        for r, written_token_ids, last in releases:
            self._table.finish(r.request, written_token_ids)
            if last is not None:
                out.append((r.outlet.stream, last))

    def _fail_step(
        self, batch: list[Running], error: Exception, span: Span | None, out: list[Delivery]
    ) -> None:
        """A step failed: every request in it fails with `error`; the others go on."""
        if span is not None:
            span.record_exception(error)
            span.end()
        _LOG.error("decode step over %s failed", plural(len(batch), "sequence"), exc_info=error)
        failed = {id(r) for r in batch}
        for r in batch:
            self._end(r, [], error, out)
        self._running = [r for r in self._running if id(r) not in failed]

    def _fail_all(self, error: BaseException) -> None:
        """Every request still here ends with `error`, after the events the last iteration
        had not handed out yet, once no step in flight writes its blocks."""
        out, self._out = self._out, []
        steps, self._steps = self._steps, []
        for step in steps:  # oldest first: each done before its requests' blocks go back
            try:
                if step.sample is None:  # died between the forward and the sampling
                    self._settle()
                else:
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
        ended += [(r.request, r.outlet) for r in self._preempted.take_all()]
        ended += [(j.request, j.outlet) for j in joins]
        self._running = []
        for request, outlet in ended:
            self._table.finish(request)
            out.append((outlet.stream, error))
        deliver_threadsafe(out)
