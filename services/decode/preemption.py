"""Requests decode's batch thread preempted when the KV pool ran dry, until they run again.
Batch thread only.

The request preempted is the running one of the largest priority value (the caller's, lower
first, vLLM's sense), among equals the one that joined last; preempted requests resume in the
reverse order (`rank`). Preempting takes a running request's blocks back
(`RequestTable.preempt`: full ones join the prefix cache) and keeps its engine sequence: its
tokens, penalties, constraint state and seeded draws. While any request waits here the request
table admits no new one, so the blocks that free are theirs first. Each batch iteration
`resume`s them, first ranked first, until one does not fit: a request gets blocks for all it
wrote and the next position, with one spare per running request (so that it is not the next
one preempted at once); the K/V its cached blocks no longer hold is computed again by prefill
forwards on decode's runner, one chunk a batch iteration (the others' steps go on between its
chunks, as with a chunked prefill), and then it runs from the next step as if it had never
stopped. One request resumes at a time, and its blocks are lent: a running request ranked
before it that is a block short mid-resume preempts it again (what its chunks computed so far
stays in the prefix cache).

A traced request's wait is a `decode preempted` span beneath its `decode request` span, from
the preemption to the end of its recompute (or its end), with what it held and recomputed.

    running ──preempt (a block short; the last ranked)──▶ waiting here ──resume──▶ running
                                                             │   ▲            │
                                                             │   └────────────┘ one ranked before
                                                             │                  it a block short
                                                             └── cancelled: ends, holding no block
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, Span

from mili.engine.step.device import settle
from mili.engine.step.runner import ModelRunner
from mili.plural import plural
from mili.telemetry.metrics import DecodeMetrics
from mili.watchdog import Progress
from services.decode.batch import Running, grow
from services.decode.requests import RequestTable

_LOG = logging.getLogger("mili.decode")
_TRACER = trace.get_tracer("mili.decode")  # a no-op until tracing installs a provider

# Tokens per forward when a resumed request's K/V is computed again: a bounded activation size,
# as a prefill chunk.
RECOMPUTE_CHUNK_TOKENS = 512


def rank(r: Running) -> tuple[int, int]:
    """Sort key, first to keep (and resume) first: priority, then when it joined."""
    return r.request.priority, r.order


class Preempted:
    """The preempted requests, by `rank`."""

    def __init__(
        self,
        runner: ModelRunner,
        table: RequestTable,
        metrics: DecodeMetrics,
        progress: Progress,
    ) -> None:
        """`progress`: the batch thread's (the watchdog's), moved on at every recomputed chunk:
        a long context computed again is work, not a stall."""
        self._runner = runner
        self._table = table
        self._metrics = metrics
        self._progress = progress
        self.waiting: list[Running] = []
        self.num_preemptions = 0
        self._spans: dict[int, Span] = {}  # id(r) -> its `decode preempted` span, when traced
        self._resuming: _Resuming | None = None

    def __bool__(self) -> bool:
        return bool(self.waiting) or self._resuming is not None

    def make_room(
        self, running: list[Running], is_joining_after: Callable[[Running], bool]
    ) -> list[Running]:
        """No step in flight: cover the position the next step writes for every one of
        `running`, first ranked first, while the pool is a block short preempting the last
        ranked of them (taken out of `running`) and the one resuming. The one asking, when it
        is the last, sits the next step out if `is_joining_after` it (a request that will rank
        after it is about to join: its blocks are taken, and it is the one to preempt once it
        runs), and is preempted itself if not. Returns the requests that sit the next step
        out."""
        if grow(self._table, running):  # the common case: nothing to preempt
            return []
        by_rank = sorted(running, key=rank)
        while by_rank:
            if grow(self._table, by_rank[:1]):
                del by_rank[0]
            elif self.add_resuming_if_after(by_rank[-1]):
                continue  # its blocks are back: try again
            elif len(by_rank) == 1 and is_joining_after(by_rank[0]):
                return by_rank
            else:
                victim = by_rank.pop()
                running.remove(victim)
                self.add(victim)
        return []

    def add(self, r: Running, computed: list[int] | None = None) -> None:
        """Take the blocks of `r` (out of the batch, in no step in flight) back; it waits here.
        `computed`: the tokens whose K/V its blocks hold (default: all it wrote)."""
        written = r.seq.written_token_ids() if computed is None else computed
        num_blocks = self._table.preempt(r.request, written)
        parent = r.outlet.span_context
        if parent is not None:
            self._spans[id(r)] = _TRACER.start_span(
                "decode preempted",
                context=trace.set_span_in_context(NonRecordingSpan(parent)),
                attributes={
                    "mili.decode.output_tokens": len(r.seq.output_token_ids),
                    "mili.decode.blocks_back": num_blocks,
                },
            )
        self.waiting.append(r)
        self.waiting.sort(key=rank)
        self.num_preemptions += 1
        self._metrics.preemptions.inc()
        _LOG.info(
            "request %s preempted after %s: %s back; it resumes once blocks free",
            r.request.name,
            plural(len(r.seq.output_token_ids), "output token"),
            plural(num_blocks, "KV block"),
        )

    def add_resuming_if_after(self, r: Running) -> bool:
        """When the request resuming ranks after `r` (the last ranked running one, a block
        short), it is preempted again, keeping in the prefix cache the blocks its chunks
        computed so far; True. Its blocks were lent for its resume, not taken from requests
        ranked before it."""
        resuming = self._resuming
        if resuming is None or rank(resuming.r) <= rank(r):
            return False
        self._stop_resuming()
        recomputed = resuming.position - resuming.num_cached
        self._end_span(resuming.r, recomputed_tokens=recomputed, cached_tokens=resuming.num_cached)
        _LOG.info(
            "request %s stops resuming (%s of %s computed again): a request ranked before it "
            "is a block short",
            resuming.r.request.name,
            plural(recomputed, "token"),
            len(resuming.written) - resuming.num_cached,
        )
        self.add(resuming.r, resuming.written[: resuming.position])
        return True

    @property
    def is_resuming(self) -> bool:
        """A request has its blocks and its K/V is being computed again: work each iteration."""
        return self._resuming is not None

    def take_cancelled(self) -> list[Running]:
        """The cancelled ones, no longer here: the waiting hold no block; one resuming holds
        its blocks, with no write of its recompute still queued (the caller ends it)."""
        cancelled = [r for r in self.waiting if r.request.is_cancelled]
        if cancelled:
            self.waiting = [r for r in self.waiting if not r.request.is_cancelled]
        resuming = self._resuming
        if resuming is not None and resuming.r.request.is_cancelled:
            self._stop_resuming()
            cancelled.append(resuming.r)
        for r in cancelled:
            self._end_span(r)
        return cancelled

    def take_all(self) -> list[Running]:
        """Everything here, gone (a batch thread that stops)."""
        waiting, self.waiting = self.waiting, []
        if self._resuming is not None:
            waiting.append(self._stop_resuming().r)
        for r in waiting:
            self._end_span(r)
        return waiting

    def _end_span(self, r: Running, error: Exception | None = None, **attributes: int) -> None:
        span = self._spans.pop(id(r), None)
        if span is not None:
            span.set_attributes({f"mili.decode.{k}": v for k, v in attributes.items()})
            if error is not None:
                span.record_exception(error)
            span.end()

    def resume(self, num_running: int) -> Iterator[tuple[Running, Exception | None]]:
        """One batch iteration's resuming: requests get blocks by `rank` until one does not
        fit beside `num_running` running ones (the rest wait behind it), and one chunk of
        RECOMPUTE_CHUNK_TOKENS is computed again, so that a long context resumes over several
        iterations with the batch's steps between its chunks, as a chunked prefill. Yields
        each request whose K/V is all back, with None (it runs from the next step), or with
        the error that failed its recompute (its blocks are its own again: the caller ends
        it)."""
        chunks = 1  # this iteration's
        while True:
            if self._resuming is None:
                self._resuming = self._start(num_running)
                if self._resuming is None:
                    return
            resuming = self._resuming
            r = resuming.r
            if resuming.position < len(resuming.written):
                if not chunks:
                    return
                chunks -= 1
                try:
                    self._compute_chunk(resuming)
                except Exception as e:  # this request alone fails
                    _LOG.error("request %s: its K/V could not be computed again", r.request.name)
                    self._stop_resuming()
                    self._end_span(r, e)
                    yield r, e
                    continue
                if resuming.position < len(resuming.written):
                    return  # more next iteration
            self._stop_resuming()
            recomputed = len(resuming.written) - resuming.num_cached
            self._end_span(r, recomputed_tokens=recomputed, cached_tokens=resuming.num_cached)
            _LOG.info(
                "request %s resumed: %s computed again over %.1f ms (%s from the prefix cache)",
                r.request.name,
                plural(recomputed, "token"),
                (time.perf_counter() - resuming.started) * 1000,
                plural(resuming.num_cached, "token"),
            )
            num_running += 1
            yield r, None

    def _stop_resuming(self) -> _Resuming:
        """The request resuming, no longer here, once the device has run every write of its
        recompute queued so far: its blocks may go back at once (it ends, or is preempted
        again) to an owner whose KV prefill writes from another stream or process."""
        resuming = self._resuming
        assert resuming is not None
        settle(self._runner.kv_cache.device)
        self._resuming = None
        return resuming

    def _start(self, num_running: int) -> _Resuming | None:
        """Blocks for the first waiting request, or None when it does not fit."""
        if not self.waiting:
            return None
        r = self.waiting[0]
        written = r.seq.written_token_ids()
        num_cached = self._table.resume(r.request, written, spare_blocks=num_running)
        if num_cached is None:
            return None
        del self.waiting[0]
        r.seq.block_table = r.request.block_table  # a new list (the device's copy is stale)
        return _Resuming(r, written, num_cached, num_cached, time.perf_counter())

    def _compute_chunk(self, resuming: _Resuming) -> None:
        """Write the K/V of the next chunk of `resuming`'s tokens into its blocks (one prefill
        forward, queued; the logits are not read)."""
        begin = resuming.position
        chunk = resuming.written[begin : begin + RECOMPUTE_CHUNK_TOKENS]
        self._progress.busy(
            f"computing again a resumed request's K/V at position {begin} "
            f"({len(chunk)} of {len(resuming.written)} tokens)"
        )
        with torch.inference_mode():
            self._runner.prefill([chunk], [resuming.r.seq.block_table], [begin])
        resuming.position += len(chunk)


@dataclass(eq=False)
class _Resuming:
    """A request given its blocks again, its K/V computed back a chunk per iteration."""

    r: Running
    written: list[int]  # the tokens whose K/V it held: all but its newest
    num_cached: int  # leading tokens the prefix cache still held
    position: int  # the next token to compute
    started: float  # perf_counter() when it got its blocks
