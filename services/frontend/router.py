"""Which prefill and decode instance a request goes to: instance state and the choice, pure.

The view of each instance comes from two sources:

    polled Info (every poll_interval_s)   free KV blocks (decode), queued prompt tokens (prefill)
    local accounting (every request)      work routed since that poll, requests in flight

so a burst of requests between two polls spreads out instead of piling onto the instance that
looked emptiest at the last poll. Decode is chosen first (it owns the scarce KV memory): most
free blocks net of blocks routed since the poll, then fewest requests in flight, then the one
chosen longest ago. The prefill is the compatible one with the fewest queued prompt tokens
(polled plus routed since), then the same tie-breaks.

Prefix affinity. Given how many leading prompt chunks each instance probably holds (from the
frontend's `PrefixIndex`), the decode instance with the longest match goes first, and among the
compatible prefills the one with the longest match, unless that instance is loaded past the
others: decode with more than `affinity_slack_requests` requests in flight above the least loaded
candidate (or fewer free blocks than the request needs), prefill with more than
`affinity_slack_tokens` queued tokens above the least queued. Then the load order decides, so a
popular prefix spreads once its instance is busy.

Room. An instance that turned a request away for capacity (decode: its blocks or
--max-running; prefill: its queued tokens) is marked full (`mark_full`) and left out of
`candidates(skip_full=True)` until it may have room again: its next Info, or a request of ours
leaving it (`finish`, `mark_room`). Each instance counts those moments (`room_clock`), so a
refusal that was asked before the latest of them does not mark it full: the room it reported
missing may have freed since. The frontend's admission queue (admitter.py) waits while every
candidate is full.

A (prefill, decode) pair is routable only once both are up and their KV layouts were checked
equal (`set_pair_error(p, d, None)`); a pair with a layout mismatch keeps its error message,
which requests get as FAILED_PRECONDITION when no compatible pair is left.

Membership changes while serving (instances found by DNS come and go, see backends.py):

    set_members(prefills, decodes)
      new address        joins DOWN: routed only once an Info answered and its pairs checked
      vanished, idle     dropped at once
      vanished, busy     DRAINING: no new requests; its requests in flight finish there, and
                         the last one's `finish` drops it (`take_dropped` hands it to the
                         caller, which then closes its channel)
      back while draining  serves again as it was
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from mili.errors import FailedPrecondition, Unavailable
from services.frontend.prefix_index import PrefixIndex


class State(enum.Enum):
    """An instance as the frontend sees it (reported in Info and metrics)."""

    DOWN = "down"  # no Info answer yet, or the last one failed: not routed
    UP = "up"  # answering: routed (with the pairs whose layouts match)
    DRAINING = "draining"  # gone from discovery: no new requests, its own ones finish


@dataclass
class DecodeView:
    address: str
    is_up: bool = False
    is_draining: bool = False  # left the membership; dropped once num_in_flight is 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    max_context_tokens: int = 0
    num_blocks_since_poll: int = 0  # blocks of requests routed here since the last Info
    num_in_flight: int = 0
    last_chosen: int = 0  # a sequence number; lower = longer ago
    full: str | None = None  # why it turned a request away for room; None: it may have room
    room_clock: int = 0  # times it may have got room back (see `Router.mark_full`)

    @property
    def is_routable(self) -> bool:
        return self.is_up and not self.is_draining

    @property
    def free_estimate(self) -> int:
        return self.num_free_blocks - self.num_blocks_since_poll


@dataclass
class PrefillView:
    address: str
    is_up: bool = False
    is_draining: bool = False
    num_queued_tokens: int = 0
    max_prompt_tokens: int = 0
    num_tokens_since_poll: int = 0  # prompt tokens routed here since the last Info
    num_in_flight: int = 0
    last_chosen: int = 0
    full: str | None = None
    room_clock: int = 0

    @property
    def is_routable(self) -> bool:
        return self.is_up and not self.is_draining

    @property
    def queued_estimate(self) -> int:
        return self.num_queued_tokens + self.num_tokens_since_poll


_V = TypeVar("_V", PrefillView, DecodeView)


@dataclass(frozen=True)
class Route:
    prefill: str
    decode: str


@dataclass(frozen=True)
class Ticket:
    """A request's accounting on its route; hand it back to `Router.finish`."""

    route: Route
    num_prompt_tokens: int
    num_blocks: int  # KV blocks the request holds on decode at its longest


@dataclass(frozen=True)
class MemberChanges:
    """What one `set_members` changed, each list in the order given."""

    added: list[str] = field(default_factory=list)  # new: DOWN until their Info answers
    draining: list[str] = field(default_factory=list)  # vanished with requests in flight
    dropped: list[str] = field(default_factory=list)  # vanished and idle: gone now
    returned: list[str] = field(default_factory=list)  # were draining, members again

    def __bool__(self) -> bool:
        return bool(self.added or self.draining or self.dropped or self.returned)


@dataclass(frozen=True)
class Member:
    kind: str  # "prefill" or "decode"
    address: str
    state: State
    num_in_flight: int


class Router:
    def __init__(
        self,
        prefill_addresses: Sequence[str] = (),
        decode_addresses: Sequence[str] = (),
        *,
        prefix_index: PrefixIndex | None = None,
        affinity_slack_requests: int = 8,
        affinity_slack_tokens: int = 8192,
    ) -> None:
        """Start with these members (more come and go with `set_members`)."""
        self.prefix_index = PrefixIndex() if prefix_index is None else prefix_index
        self.affinity_slack_requests = affinity_slack_requests
        self.affinity_slack_tokens = affinity_slack_tokens
        self.prefills = {a: PrefillView(a) for a in prefill_addresses}
        self.decodes = {a: DecodeView(a) for a in decode_addresses}
        # (prefill, decode) -> None when the layouts were checked equal, else the mismatch
        self._pair_errors: dict[tuple[str, str], str | None] = {}
        self._clock = itertools.count(1)
        self._dropped: list[str] = []  # drained since the last take_dropped

    # ---- membership --------------------------------------------------------------------------

    def set_members(self, prefills: Sequence[str], decodes: Sequence[str]) -> MemberChanges:
        """The instances discovery now knows: add the new, drain or drop the vanished."""
        changes = MemberChanges()
        self._set_members(self.prefills, prefills, PrefillView, changes)
        self._set_members(self.decodes, decodes, DecodeView, changes)
        return changes

    def _set_members(
        self,
        views: dict[str, _V],
        addresses: Sequence[str],
        make: Callable[[str], _V],
        changes: MemberChanges,
    ) -> None:
        wanted = dict.fromkeys(addresses)
        for address in wanted:
            view = views.get(address)
            if view is None:
                views[address] = make(address)
                changes.added.append(address)
            elif view.is_draining:
                view.is_draining = False
                changes.returned.append(address)
        for address, view in list(views.items()):
            if address in wanted or view.is_draining:
                continue
            if view.num_in_flight == 0:
                self._drop(address)
                changes.dropped.append(address)
            else:
                view.is_draining = True
                changes.draining.append(address)

    def take_dropped(self) -> list[str]:
        """Instances dropped by `finish` once drained, since the last call (close their
        channels)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def members(self) -> list[Member]:
        """Every known instance, prefill first, each kind in the order it joined."""
        return [
            Member(kind, v.address, _state(v), v.num_in_flight)
            for kind, views in (("prefill", self.prefills), ("decode", self.decodes))
            for v in views.values()
        ]

    def _drop(self, address: str) -> None:
        self.prefills.pop(address, None)
        self.decodes.pop(address, None)
        for pair in [p for p in self._pair_errors if address in p]:
            del self._pair_errors[pair]
        self.prefix_index.forget(address)

    # ---- updates from Info polling -----------------------------------------------------------

    def update_prefill(
        self,
        address: str,
        *,
        num_queued_tokens: int,
        max_prompt_tokens: int,
        caches_prefixes: bool = True,
    ) -> None:
        view = self.prefills.get(address)
        if view is None:  # dropped while its Info call was out
            return
        self.prefix_index.set_caching(address, caches_prefixes)
        view.is_up = True
        view.num_queued_tokens = num_queued_tokens
        view.max_prompt_tokens = max_prompt_tokens
        view.num_tokens_since_poll = 0
        _room(view)

    def update_decode(
        self,
        address: str,
        *,
        num_free_blocks: int,
        num_total_blocks: int,
        max_context_tokens: int,
        caches_prefixes: bool = True,
    ) -> None:
        view = self.decodes.get(address)
        if view is None:
            return
        self.prefix_index.set_caching(address, caches_prefixes)
        view.is_up = True
        view.num_free_blocks = num_free_blocks
        view.num_total_blocks = num_total_blocks
        view.max_context_tokens = max_context_tokens
        view.num_blocks_since_poll = 0
        _room(view)

    def mark_down(self, address: str) -> None:
        """The instance did not answer: route around it until an Info call succeeds again."""
        view = self.prefills.get(address) or self.decodes.get(address)
        if view is None:
            raise KeyError(address)
        if view.is_up:  # a restart empties its prefix cache
            self.prefix_index.forget(address)
        view.is_up = False

    def set_pair_error(self, prefill: str, decode: str, error: str | None) -> None:
        """Record the layout check of a pair: None = compatible, else why not."""
        if prefill in self.prefills and decode in self.decodes:
            self._pair_errors[(prefill, decode)] = error

    def pair_error(self, prefill: str, decode: str) -> str | None:
        return self._pair_errors.get((prefill, decode))

    def is_compatible(self, prefill: str, decode: str) -> bool:
        key = (prefill, decode)
        return key in self._pair_errors and self._pair_errors[key] is None

    def route_problem(self) -> str | None:
        """None when some up prefill and up decode instance form a compatible pair; else why
        not (the frontend then reports NOT_SERVING)."""
        up_decodes = [d.address for d in self.decodes.values() if d.is_routable]
        up_prefills = [p.address for p in self.prefills.values() if p.is_routable]
        if not up_decodes:
            return f"no decode instance is up (of {_names(self.decodes)})"
        if not up_prefills:
            return f"no prefill instance is up (of {_names(self.prefills)})"
        if any(self.is_compatible(p, d) for p in up_prefills for d in up_decodes):
            return None
        return "no up prefill/decode pair is compatible (see the frontend's REFUSING PAIR errors)"

    # ---- room --------------------------------------------------------------------------------

    def room_clock(self, address: str) -> int:
        """How many times `address` may have got room back so far: read it before asking the
        instance, hand it to `mark_full` with its refusal."""
        return self._view(address).room_clock

    def mark_full(self, address: str, why: str, *, seen_clock: int) -> None:
        """`address` turned a request away for room (`why`), asked when its `room_clock` read
        `seen_clock`: leave it out of `candidates(skip_full=True)` until it may have room
        again. Ignored when it may have had room since (or it was dropped)."""
        view = self.prefills.get(address) or self.decodes.get(address)
        if view is not None and view.room_clock == seen_clock:
            view.full = why

    def mark_room(self, address: str) -> None:
        """`address` may have room again (e.g. a prefill call of ours on it ended)."""
        view = self.prefills.get(address) or self.decodes.get(address)
        if view is not None:
            _room(view)

    def full_instances(self) -> dict[str, str]:
        """Routable instances marked full: address -> why."""
        views: list[_View] = [*self.prefills.values(), *self.decodes.values()]
        return {v.address: v.full for v in views if v.is_routable and v.full is not None}

    def _view(self, address: str) -> PrefillView | DecodeView:
        view = self.prefills.get(address) or self.decodes.get(address)
        if view is None:
            raise KeyError(address)
        return view

    # ---- the choice --------------------------------------------------------------------------

    @property
    def max_context_tokens(self) -> int | None:
        """The smallest context window among up decode instances (None when none is up)."""
        windows = [d.max_context_tokens for d in self.decodes.values() if d.is_routable]
        return min(windows) if windows else None

    @property
    def max_prompt_tokens(self) -> int | None:
        limits = [p.max_prompt_tokens for p in self.prefills.values() if p.is_routable]
        return min(limits) if limits else None

    def candidates(
        self,
        exclude: Collection[str] = (),
        affinity: Mapping[str, int] | None = None,
        blocks_needed_on: Callable[[str], int] | None = None,
        *,
        skip_full: bool = False,
    ) -> list[Route]:
        """Routes to try, best first: one per up decode instance (not in `exclude`) that has an
        up, layout-compatible prefill instance. `affinity`: leading prompt chunks each instance
        probably holds (absent: none); `blocks_needed_on(address)`: the blocks the request needs
        on that decode instance, in its block size (None: nothing); `skip_full`: leave out
        instances marked full (`mark_full`).

        Raises Unavailable when no instance of a kind is up, FailedPrecondition (with the
        layouts) when instances are up but no pair is compatible. Returns [] when every
        candidate is excluded or full (the caller knows why it excluded them; `full_instances`
        says which are full).
        """
        up_decodes = [d for d in self.decodes.values() if d.is_routable]
        up_prefills = [p for p in self.prefills.values() if p.is_routable]
        if not up_decodes:
            raise Unavailable(f"no decode instance is reachable (tried {_names(self.decodes)})")
        if not up_prefills:
            raise Unavailable(f"no prefill instance is reachable (tried {_names(self.prefills)})")
        routes: list[Route] = []
        mismatch: str | None = None
        is_any_full = False
        affinity = affinity or {}
        for decode in self._decode_order(up_decodes, affinity, blocks_needed_on):
            compatible = [p for p in up_prefills if self.is_compatible(p.address, decode.address)]
            if not compatible:
                mismatch = mismatch or next(
                    (e for p in up_prefills if (e := self.pair_error(p.address, decode.address))),
                    None,
                )
                continue
            if decode.address in exclude:
                continue
            if skip_full:
                compatible = [p for p in compatible if p.full is None]
                if decode.full is not None or not compatible:
                    is_any_full = True
                    continue
            prefill = self._best_prefill(compatible, affinity)
            routes.append(Route(prefill.address, decode.address))
        if not routes and not exclude and not is_any_full:
            if mismatch is not None:
                raise FailedPrecondition(mismatch)
            raise Unavailable("no prefill/decode pair has had its KV layouts checked yet")
        return routes

    def _decode_order(
        self,
        decodes: list[DecodeView],
        affinity: Mapping[str, int],
        blocks_needed_on: Callable[[str], int] | None,
    ) -> list[DecodeView]:
        ordered = sorted(decodes, key=_decode_order)
        least_in_flight = min(d.num_in_flight for d in decodes)
        fits = [
            d
            for d in ordered
            if affinity.get(d.address, 0) > 0
            and d.num_in_flight <= least_in_flight + self.affinity_slack_requests
            and (blocks_needed_on is None or d.free_estimate >= blocks_needed_on(d.address))
        ]
        if not fits:
            return ordered
        best = max(fits, key=lambda d: affinity[d.address])  # stable: ties keep load order
        return [best] + [d for d in ordered if d is not best]

    def _best_prefill(
        self, prefills: list[PrefillView], affinity: Mapping[str, int]
    ) -> PrefillView:
        by_load = min(prefills, key=_prefill_order)
        fits = [
            p
            for p in sorted(prefills, key=_prefill_order)
            if affinity.get(p.address, 0) > 0
            and p.queued_estimate <= by_load.queued_estimate + self.affinity_slack_tokens
        ]
        return max(fits, key=lambda p: affinity[p.address]) if fits else by_load

    def start(self, route: Route, num_prompt_tokens: int, num_blocks: int) -> Ticket:
        """Count a request on `route` as soon as it is chosen, so concurrent choices see it."""
        now = next(self._clock)
        decode = self.decodes[route.decode]
        decode.num_in_flight += 1
        decode.num_blocks_since_poll += num_blocks
        decode.last_chosen = now
        prefill = self.prefills[route.prefill]
        prefill.num_in_flight += 1
        prefill.num_tokens_since_poll += num_prompt_tokens
        prefill.last_chosen = now
        return Ticket(route, num_prompt_tokens, num_blocks)

    def finish(self, ticket: Ticket, *, is_refused: bool = False) -> None:
        """The request left its route; `is_refused`: the decode instance never admitted it, so
        its blocks do not count against that instance either. One that was admitted leaves
        room on its decode instance (its blocks and its place in the batch)."""
        decode = self.decodes[ticket.route.decode]
        prefill = self.prefills[ticket.route.prefill]
        decode.num_in_flight -= 1
        prefill.num_in_flight -= 1
        if is_refused:
            decode.num_blocks_since_poll = max(0, decode.num_blocks_since_poll - ticket.num_blocks)
            prefill.num_tokens_since_poll = max(
                0, prefill.num_tokens_since_poll - ticket.num_prompt_tokens
            )
        else:
            _room(decode)
        for view in (decode, prefill):
            if view.is_draining and view.num_in_flight == 0:
                self._drop(view.address)
                self._dropped.append(view.address)


_View = PrefillView | DecodeView


def _state(view: _View) -> State:
    if view.is_draining:
        return State.DRAINING
    return State.UP if view.is_up else State.DOWN


def _room(view: _View) -> None:
    view.full = None
    view.room_clock += 1


def _names(views: Mapping[str, object]) -> str:
    return ", ".join(views) or "none known: discovery found no instance"


def _decode_order(d: DecodeView) -> tuple[int, int, int]:
    return (-d.free_estimate, d.num_in_flight, d.last_chosen)


def _prefill_order(p: PrefillView) -> tuple[int, int, int]:
    return (p.queued_estimate, p.num_in_flight, p.last_chosen)
