"""Admitted requests: block reservations, leases and who may free what. Pure Python, thread-safe.

Life of a request (every arrow is one RequestTable method, taken under the table's lock):

    admit ──▶ WAITING ──begin_transfer──▶ TRANSFERRING ──start_running──▶ RUNNING ──finish──▶ DONE
                 │                            │                              │
                 └──── cancel / expire ───────┴──────────▶ DONE              └─ cancel: flag only;
                       (blocks freed now, or when the last pin drops)           the batch thread
                                                                                drops it, finish
Who frees the blocks:
- WAITING / TRANSFERRING: whoever ends the request (Generate's lease timer or cancellation, a
  failed transfer). A chunk being scattered into the cache at that moment *pins* the request, and
  the blocks are freed by the unpin instead: a block must never be handed to a new request while
  a stale copy is still being written into it.
- RUNNING: only the batch thread (`finish`), after it has dropped the request from its batch: the
  model may be writing a new token's K/V into those blocks right now.

Growth and preemption. Admission reserves the blocks of the prompt and of the first outputs
(block_pool.blocks_to_reserve); the batch thread `grow`s a RUNNING request's table as it
writes past them. When the pool has no block left for that, the batch thread `preempt`s its
last ranked request (services/decode/preemption.py): its blocks go back (their full ones into
the prefix cache) and it waits, still RUNNING, until `resume` finds blocks for all it wrote,
which the batch thread then computes again. While a request waits so, no new request is
admitted: the blocks that free are its first.

The lock also guards the BlockPool: the event loop, the batch thread and scatter threads all
reach it through this table.

First come, first served across frontends. Each frontend queues its own requests head of line,
so a large request waiting in one is not protected from small ones another frontend keeps
sending (`--frontends N`, several replicas): each would take the blocks freed while the large
one waits. So the table holds room for the earliest request it turned away for blocks: until
that one is admitted, or has not asked again for HOLD_S (it went elsewhere, or gave up), another
request is admitted only where the blocks left still cover it. Priority comes before arrival,
as in each frontend's queue: a request of a lower priority value than the held one's passes
the hold, and takes it over when it is turned away too.

Prefix cache. With caching on, admission reuses the longest cached run of full blocks of the
prompt (`num_cached_blocks`, never the block holding the last prompt token: prefill always sends
that one), so prefill sends only the blocks after them; a request that ran keeps the full blocks
of every token whose K/V it wrote (prompt and output) in the cache when it finishes.
"""

from __future__ import annotations

import enum
import hmac
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mili.engine.kv.block_pool import (
    BlockPool,
    BlockPoolExhausted,
    blocks_at_longest,
    blocks_needed,
    blocks_to_reserve,
    max_cached_blocks,
)
from mili.engine.kv.prefix_cache import PrefixCache, PrefixCacheReading
from mili.engine.sampling_params import SamplingParams
from mili.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from mili.plural import plural

if TYPE_CHECKING:
    from mili.engine.constraint.matcher import ConstraintMatcher

# How long room is held for a request turned away for blocks without it asking again: a waiting
# request asks at every room its frontend learns of, and at least once a poll (1 s by default).
HOLD_S = 2.5


@dataclass
class _Hold:
    """Room held for the earliest request turned away for blocks."""

    request_id: str
    # every block it needs: its cached ones too, which others could evict while it waits
    num_blocks: int
    until: float  # expires unless it asks again (HOLD_S after each ask)
    priority: int  # its priority: a request of a lower value goes ahead of it


class RequestState(enum.Enum):
    WAITING = "waiting"  # blocks reserved, waiting for prefill's transfer
    TRANSFERRING = "transferring"  # a TransferKv call is writing the prompt's KV
    RUNNING = "running"  # KV landed; the batch thread owns it
    DONE = "done"  # finished, failed or cancelled


@dataclass(eq=False)
class DecodeRequest:
    """One admitted request. `block_table` covers every position whose K/V will be written.

    Bookkeeping only: where its events go (its stream, its span) is the servicers' `Outlets`
    (services/decode/stream.py), keyed by request id."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_table: list[int]  # the whole reservation, in token order
    num_prompt_blocks: int  # block_table[:num_prompt_blocks] hold the prompt (prefill fills them)
    lease_deadline: float  # monotonic seconds; the KV must be committed before
    lease_ms: int
    # The secret a transfer's header must carry (handed out in Admitted): whoever else learns
    # the request's id cannot fill, or end, its reservation.
    transfer_token: str = field(default_factory=lambda: secrets.token_hex(16))
    client_request_id: str = ""  # the caller's own id, a label for logs and traces
    state: RequestState = RequestState.WAITING
    is_cancelled: bool = False  # RUNNING only: the batch thread drops it at its next step
    num_pins: int = 0  # scatters in flight into its blocks
    is_freed: bool = False
    # block_table[:num_cached_blocks] came from the prefix cache, their KV already in place.
    num_cached_blocks: int = 0
    # params.constraint's state, in its start state until the batch accepts prefill's first
    # token; set by admission (compiled off the event loop), None when unconstrained.
    matcher: ConstraintMatcher | None = None
    is_preempted: bool = False  # RUNNING, its blocks taken back until `resume`
    priority: int = 0  # the caller's (lower first): the largest is preempted first

    @property
    def name(self) -> str:
        """How messages name it: the caller's id first (what they know), then ours."""
        if self.client_request_id and self.client_request_id != self.request_id:
            return f"{self.client_request_id!r} (id {self.request_id})"
        return repr(self.request_id)

    @property
    def prompt_block_ids(self) -> list[int]:
        return self.block_table[: self.num_prompt_blocks]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def received_block_ids(self) -> list[int]:
        """The prompt blocks prefill fills: those after the cached ones."""
        return self.block_table[self.num_cached_blocks : self.num_prompt_blocks]


class RequestTable:
    """The active requests of one decode instance and the block pool they draw from."""

    def __init__(
        self, pool: BlockPool, block_size: int, max_requests: int, *, prefix_caching: bool = False
    ) -> None:
        self._pool = pool
        self._cache = PrefixCache(pool, block_size, enabled=prefix_caching)
        self.block_size = block_size
        self.max_requests = max_requests
        self._lock = threading.Lock()
        self._requests: dict[str, DecodeRequest] = {}
        self._hold: _Hold | None = None
        self._num_preempted = 0  # requests preempted and not resumed (or ended) since

    # ---- counts (for Info) ---------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new request can get: free ones and cached ones no request holds."""
        with self._lock:
            return self._cache.num_available

    def prefix_cache_reading(self) -> PrefixCacheReading:
        with self._lock:
            return self._cache.reading()

    def _count(self, *states: RequestState) -> int:
        with self._lock:
            return sum(r.state in states for r in self._requests.values())

    @property
    def num_waiting(self) -> int:
        return self._count(RequestState.WAITING, RequestState.TRANSFERRING)

    @property
    def num_running(self) -> int:
        """In the running batch: RUNNING and not preempted."""
        with self._lock:
            return sum(
                r.state is RequestState.RUNNING and not r.is_preempted
                for r in self._requests.values()
            )

    @property
    def num_preempted(self) -> int:
        with self._lock:
            return self._num_preempted

    def get(self, request_id: str) -> DecodeRequest | None:
        with self._lock:
            return self._requests.get(request_id)

    # ---- transitions ---------------------------------------------------------------------------

    def admit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        lease_ms: int,
        now: float,
        retry_after_s: float | None = None,
        client_request_id: str = "",
        priority: int = 0,
    ) -> DecodeRequest:
        """Reserve the request's blocks (blocks_to_reserve: all or nothing) and register it.

        Raises InvalidArgument for an id already active, ResourceExhausted (with
        `retry_after_s`) when the request bound is reached, a preempted request waits for
        blocks, or the blocks do not fit.
        """
        num_blocks = blocks_to_reserve(len(prompt_token_ids), params.max_tokens, self.block_size)
        longest = blocks_at_longest(len(prompt_token_ids), params.max_tokens, self.block_size)
        if longest > self._pool.num_blocks:  # it would wait, preempted, for room never there
            raise InvalidArgument(
                "sampling.max_tokens",
                params.max_tokens,
                f"{plural(len(prompt_token_ids), 'prompt token')} + max_tokens need "
                f"{plural(longest, 'KV block')}, more than this decode instance has in all "
                f"({self._pool.num_blocks})",
            )
        with self._lock:
            if request_id in self._requests:
                raise InvalidArgument(
                    "request_id", request_id, "already exists: a request with this id is active"
                )
            if len(self._requests) >= self.max_requests:
                raise ResourceExhausted(
                    f"decode instance is full: {plural(len(self._requests), 'request')} admitted "
                    f"(limit {self.max_requests}); retry later or on another instance",
                    retry_after_s,
                )
            if self._num_preempted:
                waiting = plural(self._num_preempted, "preempted request")
                verb = "waits" if self._num_preempted == 1 else "wait"
                raise ResourceExhausted(
                    f"decode instance is out of KV blocks: {waiting} {verb} for blocks first; "
                    "retry later or on another instance",
                    retry_after_s,
                )
            most = max_cached_blocks(len(prompt_token_ids), self.block_size)
            cached = self._cache.match(prompt_token_ids, max_blocks=most, record=False)
            needed = num_blocks - len(cached)
            hold = self._hold if self._hold is not None and self._hold.until > now else None
            name = client_request_id or request_id
            if (
                hold is not None
                and hold.request_id != request_id
                and priority >= hold.priority
                and self._cache.num_available - needed < hold.num_blocks
            ):
                self._cache.free(cached)
                raise ResourceExhausted(
                    f"not enough KV blocks for request {name!r}: {hold.num_blocks} are held "
                    "for a request turned away earlier (first come, first served)",
                    retry_after_s,
                )
            try:
                block_table = cached + self._cache.allocate(needed)
            except BlockPoolExhausted as e:
                self._cache.free(cached)
                if hold is None or hold.request_id == request_id or priority < hold.priority:
                    self._hold = _Hold(request_id, num_blocks, now + HOLD_S, priority)
                raise ResourceExhausted(
                    f"not enough KV blocks for request {name!r}: "
                    f"needs {num_blocks} "
                    f"({len(prompt_token_ids)} prompt tokens + max_tokens {params.max_tokens}), "
                    f"{e.num_free + len(cached)} of {self._pool.num_blocks} free",
                    retry_after_s,
                ) from None
            if hold is not None and hold.request_id == request_id:
                self._hold = None
            self._cache.record(len(prompt_token_ids), len(cached))
            request = DecodeRequest(
                request_id=request_id,
                prompt_token_ids=list(prompt_token_ids),
                params=params,
                block_table=block_table,
                num_prompt_blocks=blocks_needed(len(prompt_token_ids), self.block_size),
                lease_deadline=now + lease_ms / 1000,
                lease_ms=lease_ms,
                client_request_id=client_request_id,
                num_cached_blocks=len(cached),
                priority=priority,
            )
            self._requests[request_id] = request
            return request

    def begin_transfer(self, request_id: str, transfer_token: str) -> DecodeRequest:
        """WAITING -> TRANSFERRING for the transfer naming `request_id` with its token.

        NotFound when no such request waits; PermissionDenied, changing nothing, when the token
        is not the request's (a forged or misdirected header must not end someone's request).
        """
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                raise NotFound(
                    f"no reservation for request {request_id!r} on this decode instance "
                    "(never admitted, or it expired, was cancelled or failed)"
                )
            if not hmac.compare_digest(request.transfer_token, transfer_token):
                raise PermissionDenied(
                    f"the KV transfer for request {request.name} does not carry the request's "
                    "transfer token: only the prefill instance the frontend chose may send it"
                )
            if request.state is not RequestState.WAITING:
                raise NotFound(
                    f"request {request.name} is not waiting for KV (it is {request.state.value})"
                )
            request.state = RequestState.TRANSFERRING
            return request

    def pin(self, request: DecodeRequest) -> bool:
        """Hold the blocks of a TRANSFERRING request while a chunk is written into them.

        False (nothing pinned) when the request has already ended.
        """
        with self._lock:
            if request.state is not RequestState.TRANSFERRING:
                return False
            request.num_pins += 1
            return True

    def unpin(self, request: DecodeRequest) -> None:
        with self._lock:
            request.num_pins -= 1
            if request.state is RequestState.DONE:
                self._free(request)

    def start_running(self, request: DecodeRequest) -> bool:
        """TRANSFERRING -> RUNNING (the batch thread owns it now); False if it already ended."""
        with self._lock:
            if request.state is not RequestState.TRANSFERRING:
                return False
            request.state = RequestState.RUNNING
            return True

    def cancel(self, request: DecodeRequest) -> bool:
        """End `request` early; True when this call ended it (the caller then fails its stream).

        WAITING / TRANSFERRING: done now, blocks freed (after the last pin). RUNNING: flagged;
        the batch thread drops it within one step and calls `finish`.
        """
        with self._lock:
            if request.state is RequestState.RUNNING:
                was_cancelled, request.is_cancelled = request.is_cancelled, True
                return not was_cancelled
            if request.state is RequestState.DONE:
                return False
            self._end(request)
            return True

    def expire(self, request: DecodeRequest, now: float) -> bool:
        """End a request still waiting for its KV past its lease; True when it did."""
        with self._lock:
            if request.state not in (RequestState.WAITING, RequestState.TRANSFERRING):
                return False
            if now < request.lease_deadline:
                return False
            self._end(request)
            return True

    def finish(self, request: DecodeRequest, written_token_ids: Sequence[int] = ()) -> None:
        """Batch thread: `request` has left the batch (finished or cancelled); free its blocks.

        `written_token_ids`: the tokens whose K/V the request's blocks hold, in order (prompt and
        every output token but the last, which was never fed back); their full blocks join the
        prefix cache.
        """
        with self._lock:
            if request.is_preempted:  # its blocks went back when it was preempted
                request.is_preempted = False
                self._num_preempted -= 1
            elif request.state is RequestState.RUNNING and written_token_ids:
                self._cache.insert(written_token_ids, request.block_table)
            if request.state is not RequestState.DONE:
                self._end(request)

    def grow(self, request: DecodeRequest, num_positions: int) -> bool:
        """Batch thread: make a RUNNING request's block_table cover `num_positions` positions,
        extending the list in place (its running sequence holds the same list). False, taking
        nothing, when the pool has too few blocks, free or evictable."""
        missing = blocks_needed(num_positions, self.block_size) - len(request.block_table)
        if missing <= 0:
            return True
        with self._lock:
            try:
                request.block_table.extend(self._cache.allocate(missing))
            except BlockPoolExhausted:
                return False
        return True

    def is_joining_at_or_after(self, priority: int) -> bool:
        """Batch thread: whether a request admitted and not running yet (its KV on its way)
        has a priority value of at least `priority`: it joins the batch ranked after every
        running request of that priority (preemption.rank), its blocks taken already."""
        with self._lock:
            return any(
                r.state in (RequestState.WAITING, RequestState.TRANSFERRING)
                and r.priority >= priority
                for r in self._requests.values()
            )

    def preempt(self, request: DecodeRequest, written_token_ids: Sequence[int]) -> int:
        """Batch thread: take a RUNNING request's blocks back (no step in flight may write
        them); it stays RUNNING, preempted, until `resume` or `finish`. The full blocks of
        `written_token_ids` (the tokens whose K/V they hold) join the prefix cache, where
        `resume` may find them still. Returns how many blocks it held."""
        with self._lock:
            table = request.block_table
            if written_token_ids:
                self._cache.insert(written_token_ids, table)
            self._cache.free(table)
            request.block_table = []
            request.is_preempted = True
            self._num_preempted += 1
            return len(table)

    def resume(
        self, request: DecodeRequest, written_token_ids: Sequence[int], *, spare_blocks: int = 0
    ) -> int | None:
        """Batch thread: blocks again for a preempted request, covering `written_token_ids`
        and the position after them (the next step's), its longest cached run of full blocks
        taken from the prefix cache; `block_table` is a new list (the device's copy of the old
        one is stale). Returns how many leading tokens' K/V those cached blocks hold (the rest
        is the caller's to compute); None, taking nothing, when fewer than the blocks it needs
        plus `spare_blocks` (room for the running requests to grow) are available."""
        num_blocks = blocks_needed(len(written_token_ids) + 1, self.block_size)
        most = len(written_token_ids) // self.block_size
        with self._lock:
            if self._cache.num_available + most < num_blocks + spare_blocks:
                return None  # short even if all were cached: not worth hashing its tokens
            cached = self._cache.match(written_token_ids, max_blocks=most, record=False)
            needed = num_blocks - len(cached)
            if self._cache.num_available < needed + spare_blocks:
                self._cache.free(cached)
                return None
            request.block_table = cached + self._cache.allocate(needed)
            request.is_preempted = False
            self._num_preempted -= 1
            return len(cached) * self.block_size

    # ---- internals (lock held) -----------------------------------------------------------------

    def _end(self, request: DecodeRequest) -> None:
        request.state = RequestState.DONE
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]
        self._free(request)

    def _free(self, request: DecodeRequest) -> None:
        if request.num_pins == 0 and not request.is_freed:
            self._cache.free(request.block_table)
            request.is_freed = True
