"""Where one request runs: a decode instance that admits it, and what the prefix index learns.

    admit(ids)  decode instances tried best first (the router's order, with the prompt's prefix
                affinity looked up at each try: a request that waited may find it elsewhere)
                until one answers Admitted(prompt blocks); RESOURCE_EXHAUSTED or UNAVAILABLE:
                the next one (nothing was reserved yet, so that is safe); every one full ->
                NoRoom, and the request waits in the admission queue (admitter.py) for its turn
    learn       decode said how much of the prompt it held, prefill how much it had cached:
                the prefix index is corrected, and records what each instance now holds

Plain Python over domain types, like pipeline.py, which runs the admitted request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from mili.engine.kv.block_pool import blocks_at_longest, blocks_to_reserve
from mili.errors import InvalidArgument, ResourceExhausted, Unavailable
from mili.plural import plural
from services.frontend.admitter import NoRoom, is_refused_for_room
from services.frontend.calls import (
    Admitted,
    Deadline,
    DecodeStream,
    Downstream,
    InstanceDown,
    PrefillStats,
    Prompt,
    RequestIds,
)
from services.frontend.config import FrontendConfig
from services.frontend.router import Route, Ticket

_LOG = logging.getLogger("mili.frontend")


@dataclass
class Admission:
    """The request admitted on a decode instance: where, its router ticket, decode's stream."""

    route: Route
    ticket: Ticket
    stream: DecodeStream
    admitted: Admitted
    prefill_clock: int = 0  # the prefill instance's room clock when its call started


class Placement:
    """One request's admissions (it may have several: prefill can turn it away after decode
    admitted it) and the prefix index's lessons from them."""

    def __init__(
        self,
        downstream: Downstream,
        config: FrontendConfig,
        prompt: Prompt,
        deadline: Deadline,
        *,
        is_queue_bounded: bool = True,
        priority: int = 0,
    ) -> None:
        """`is_queue_bounded` False: it waits for room past the admission queue's bounds;
        `priority`: its place among waiting requests (lower first)."""
        self._downstream = downstream
        self._config = config
        self._router = downstream.router
        self._prompt = prompt
        self._deadline = deadline
        self._priority = priority
        # Cache-aware routing: the prompt's prefix keys and which instances probably hold them
        # (looked up at each admission try: a request that waited may find them elsewhere).
        index = self._router.prefix_index
        self._prefix_keys = index.keys(prompt.token_ids)
        self._affinity: dict[str, int] = {}
        self._admitter = downstream.admitter
        self._arrival = self._admitter.arrive(
            len(prompt.token_ids), is_bounded=is_queue_bounded, priority=priority
        )

    @property
    def queued_s(self) -> float:
        """In the frontend's admission queue, all its stays together."""
        return self._arrival.waited_s

    async def admit(self, ids: RequestIds, no_room: NoRoom | None) -> Admission:
        """Admitted on a decode instance as `ids`: at once, or after waiting for room in the
        queue (`no_room`: prefill turned it away, it waits first)."""
        return await self._admitter.admit(
            self._arrival, lambda: self._try_routes(ids), self._deadline, no_room=no_room
        )

    async def _try_routes(self, ids: RequestIds) -> Admission:
        """Try decode instances, best first, until one admits; nothing is reserved on those
        that refused, so moving on is safe. Raises NoRoom when every one is full (those that
        refused this time, and those known to be full, which are not asked)."""
        self._check_fits()
        index = self._router.prefix_index
        self._affinity = index.matches(self._prefix_keys, time.monotonic())
        # Decode admits a request's first outputs and grows it as it runs: one whose pool
        # could never hold the request whole is never asked.
        too_small = {
            d.address
            for d in self._router.decodes.values()
            if 0 < d.num_total_blocks < self._blocks_at_longest_on(d.address)
        }
        tried: set[str] = set()
        full: list[ResourceExhausted] = []
        down: list[InstanceDown] = []
        while (route := self._next_route(tried | too_small)) is not None:
            tried.add(route.decode)
            seen_clock = self._router.room_clock(route.decode)
            try:
                return await self._try_admit(route, ids)
            except ResourceExhausted as error:
                if not is_refused_for_room(error):
                    raise  # waiting cannot help
                self._router.mark_full(route.decode, str(error), seen_clock=seen_clock)
                full.append(error)
            except InstanceDown as error:
                down.append(error)
        known_full = self._router.full_instances()
        if full or known_full:
            reasons = [str(e) for e in full]
            reasons += [why for address, why in known_full.items() if address not in tried]
            retry = [e.retry_after_s for e in full if e.retry_after_s is not None]
            raise NoRoom(
                f"every decode instance is full ({'; '.join(reasons)})",
                retry_after_s=min(retry) if retry else None,
            )
        if down:
            raise down[-1]
        raise Unavailable("no decode instance could take the request")

    def _check_fits(self) -> None:
        """Refuse a request no decode instance could ever hold (its pool is too small), rather
        than have it wait for room that never comes, holding the queue behind it."""
        totals = {
            d.address: d.num_total_blocks
            for d in self._router.decodes.values()
            if d.is_routable and d.num_total_blocks > 0
        }
        if not totals or any(self._blocks_at_longest_on(a) <= n for a, n in totals.items()):
            return
        sampling = self._prompt.sampling
        prompt = plural(len(self._prompt.token_ids), "prompt token")
        blocks = plural(min(self._blocks_at_longest_on(a) for a in totals), "KV block")
        raise InvalidArgument(
            "sampling.max_tokens",
            sampling.max_tokens,
            f"{prompt} + max_tokens need {blocks}, more than any decode instance has in all "
            f"(at most {max(totals.values())})",
        )

    def _next_route(self, tried: set[str]) -> Route | None:
        try:
            routes = self._router.candidates(
                exclude=tried,
                affinity=self._affinity,
                blocks_needed_on=self._blocks_needed_on,
                skip_full=True,
            )
        except Unavailable:
            if not tried:
                raise
            return None  # every instance went down while we tried them; say why in _try_routes
        return routes[0] if routes else None

    async def _try_admit(self, route: Route, ids: RequestIds) -> Admission:
        """Ask one decode instance to admit the request. Raises ResourceExhausted (it is full)
        or InstanceDown (it is down, or silent past admit_timeout_s) to try the next one; any
        other error fails the request."""
        prompt = self._prompt
        block_size = self._downstream.decode_block_size(route.decode)
        ticket = self._router.start(
            route, len(prompt.token_ids), self._blocks_needed_on(route.decode)
        )
        try:
            stream = self._downstream.generate(route, ids, prompt, self._deadline, self._priority)
        except BaseException:
            self._router.finish(ticket, is_refused=True)  # the instance's count stays true
            raise
        who = f"decode at {route.decode}"
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for returns a result that lands in
            # the turn a cancel does and drops the cancel (the request then ran on for a
            # caller that had left).
            async with asyncio.timeout(self._config.admit_timeout_s):
                first = await stream.read()
            if not isinstance(first, Admitted):
                raise Unavailable(f"{who} did not admit the request (no Admitted event first)")
        except BaseException as exc:
            self._router.finish(ticket, is_refused=True)
            stream.cancel(f"not admitted: {exc!r}")
            if isinstance(exc, TimeoutError):
                self._downstream.request_refresh(down=route.decode)
                timeout_s = self._config.admit_timeout_s
                raise InstanceDown(f"{who} did not admit or refuse within {timeout_s} s") from None
            if isinstance(exc, InstanceDown):
                self._downstream.request_refresh(down=route.decode)
            raise
        _LOG.debug(
            "%r (id %s): %s, prefill %s -> decode %s, blocks %s (%d cached)",
            ids.client_request_id,
            ids.request_id,
            plural(len(prompt.token_ids), "prompt token"),
            route.prefill,
            route.decode,
            first.prompt_block_ids,
            first.num_cached_blocks,
        )
        self._learn_admitted(route, first, block_size)
        return Admission(route, ticket, stream, first)

    def _blocks_needed_on(self, decode: str) -> int:
        """Blocks `decode` reserves for the request at admission, in that instance's block
        size from its Info."""
        prompt = self._prompt
        block_size = self._downstream.decode_block_size(decode)
        return blocks_to_reserve(len(prompt.token_ids), prompt.sampling.max_tokens, block_size)

    def _blocks_at_longest_on(self, decode: str) -> int:
        """Blocks the request holds on `decode` at its longest."""
        prompt = self._prompt
        block_size = self._downstream.decode_block_size(decode)
        return blocks_at_longest(len(prompt.token_ids), prompt.sampling.max_tokens, block_size)

    def _learn_admitted(self, route: Route, admitted: Admitted, block_size: int) -> None:
        """Decode said how much of the prompt it holds: correct the index, then count the
        prompt as held by both instances (they hold it once this request is through)."""
        index = self._router.prefix_index
        self._correct(route.decode, admitted.num_cached_blocks * block_size)
        now = time.monotonic()
        index.record(route.decode, self._prefix_keys, now)
        index.record(route.prefill, self._prefix_keys, now)

    def _correct(self, address: str, num_held_tokens: int) -> None:
        """`address` holds the prompt's first `num_held_tokens` tokens, and the index expected
        more: it evicted the rest of this prefix. Only this prefix is forgotten, also when it
        held none of it: one evicted prefix says nothing of the others (an instance that
        restarted is forgotten whole when it goes down: Router.mark_down)."""
        index = self._router.prefix_index
        held = num_held_tokens // index.block_size
        if self._affinity.get(address, 0) > held:
            index.forget_from(address, self._prefix_keys, held)

    def learn_finished(
        self,
        admission: Admission,
        output_token_ids: Sequence[int],
        prefill_reply: PrefillStats | None,
    ) -> None:
        """Decode keeps the K/V of the prompt and of every output token but the last; prefill
        said how much of the prompt it had cached (`prefill_reply`, when it came)."""
        index = self._router.prefix_index
        written = [*self._prompt.token_ids, *output_token_ids][:-1]
        index.record(admission.route.decode, index.keys(written), time.monotonic())
        if prefill_reply is not None and self._prompt.sampling.prompt_logprobs is None:
            # (prompt logprobs are computed over the whole prompt: no cached tokens reported)
            self._correct(admission.route.prefill, prefill_reply.num_cached_tokens)
            index.record(admission.route.prefill, self._prefix_keys, time.monotonic())
