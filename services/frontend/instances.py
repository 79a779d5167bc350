"""Which prefill and decode instances there are, and one channel and stub to each (and the
tokenizer's channel): the membership half of the frontend's view of the services behind it.

`--prefill` / `--decode` targets are fixed addresses or `dns:///NAME:PORT` names
(mili.discovery). Every `resolve_interval_s` each name is looked up again and the router told
the instances there are now (Router.set_members): a new one gets a channel and an Info poll at
once (backends.py), and is routed once that Info answered and its layouts checked out; a
vanished one drains (its requests in flight finish there) and its channel is closed once it is
dropped. A failed lookup keeps what the name resolved to before: a resolver hiccup must not
drain every instance. A name that resolves to no address or fails its lookup is logged once
(and again when that changes) and listed in Info's target_problems until it resolves.

An instance has a stub (and, for decode, a multiplexer) exactly while it is one of the router's
members, draining ones included. Every drop, of an idle vanished instance or of a drained one
(Router.take_dropped), goes through one path: its multiplexer and channel are closed and
`on_dropped` is told, so that what its Info said is forgotten with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc

from mili.discovery import (
    NO_ADDRESS,
    LookupFailed,
    LookupProblems,
    Resolve,
    Target,
    parse_targets,
    resolve_host,
)
from mili.pb.decode.v1 import decode_pb2_grpc
from mili.pb.prefill.v1 import prefill_pb2_grpc
from mili.plural import plural
from mili.rpc.client import channel
from mili.rpc.tls import Tls
from mili.telemetry.metrics import FrontendMetrics
from services.frontend.config import FrontendConfig
from services.frontend.multiplex import DecodeMultiplexer
from services.frontend.router import MemberChanges, Router

_LOG = logging.getLogger("mili.frontend")
# HTTP/2 receive window of the channels to decode instances (no BDP probing): how far decode's
# GenerateStream may run ahead of this frontend's reading. With BDP probing it grew to
# megabytes, seconds of tokens queued in front of new requests' admissions when this frontend
# fell behind; at this size a backlog waits at decode, merged per request.
DECODE_RECEIVE_WINDOW_BYTES = 64 * 1024


class Instances:
    """The targets, what they resolve to, and the channels and stubs of the instances there."""

    def __init__(
        self,
        config: FrontendConfig,
        router: Router,
        *,
        on_changes: Callable[[MemberChanges], Awaitable[None]],
        on_dropped: Callable[[str], None],
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        tls: Tls | None = None,
        metrics: FrontendMetrics | None = None,
        resolve: Resolve = resolve_host,
    ) -> None:
        """`on_changes(changes)` is awaited after each `discover`; `on_dropped(address)` is
        called as an instance is dropped. `tls`: dial every service over TLS with these
        certificates. `resolve`: the DNS lookup (tests pass their own)."""
        self._config = config
        self._router = router
        self._on_changes = on_changes
        self._on_dropped = on_dropped
        self._interceptors = interceptors
        self._tls = tls
        self._metrics = metrics
        self._resolve = resolve
        self._targets = {
            "prefill": parse_targets(config.prefill_addresses),
            "decode": parse_targets(config.decode_addresses),
        }
        # Each target's instance addresses as last resolved (fixed ones: themselves).
        self._resolved: dict[Target, tuple[str, ...]] = {
            t: (t.spec,) for targets in self._targets.values() for t in targets if not t.is_dns
        }
        self._server_names: dict[str, str] = {}  # instance -> the DNS name that verifies it
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._prefills: dict[str, prefill_pb2_grpc.PrefillServiceStub] = {}
        self._decodes: dict[str, decode_pb2_grpc.DecodeServiceStub] = {}
        self.lookup_problems = LookupProblems(_LOG)  # names whose last lookup went wrong
        # Every request on a decode instance shares one GenerateStream (multiplex.py).
        self._multiplexers: dict[str, DecodeMultiplexer] = {}
        self._closing: set[asyncio.Future[None]] = set()  # channels of dropped instances
        self._is_started = False  # joins are logged once `start` ran
        # The tokenizer's channel is one of these too: dialed the same way, closed by `close`.
        self.tokenizer_channel = self.channel(config.tokenizer_address)
        for address in router.prefills:  # members the router came with
            self._add_stub("prefill", address)
        for address in router.decodes:
            self._add_stub("decode", address)
        self._apply(self._members())  # the fixed addresses, known before any lookup

    def prefill(self, address: str) -> prefill_pb2_grpc.PrefillServiceStub:
        return self._prefills[address]

    def decode(self, address: str) -> decode_pb2_grpc.DecodeServiceStub:
        return self._decodes[address]

    def multiplexer(self, address: str) -> DecodeMultiplexer:
        return self._multiplexers[address]

    def addresses(self, kind: str) -> list[str]:
        """Every prefill or decode instance with a stub now, draining ones included."""
        return list(self._prefills if kind == "prefill" else self._decodes)

    def targets(self, kind: str) -> tuple[Target, ...]:
        """The --prefill or --decode targets, as configured."""
        return self._targets[kind]

    def target_of(self, address: str) -> str:
        """The target (as configured) that instance `address` came from."""
        for target, addresses in self._resolved.items():
            if address in addresses:
                return target.spec
        return address  # it left every target's answer and is draining

    @property
    def has_dns_targets(self) -> bool:
        """Whether any target is a name to look up again every `resolve_interval_s`."""
        return any(t.is_dns for targets in self._targets.values() for t in targets)

    async def start(self) -> None:
        """The first round of lookups; from now on a new instance's joining is logged."""
        self._is_started = True
        await self.discover()

    async def discover(self) -> MemberChanges:
        """Look every DNS target up again and apply what changed."""
        names = [t for targets in self._targets.values() for t in targets if t.is_dns]
        answers = await asyncio.gather(*(self._lookup(t) for t in names))
        for target, ips in zip(names, answers, strict=True):
            if ips is None:
                continue  # lookup failed: keep the last answer
            self._resolved[target] = tuple(target.address(ip) for ip in ips)
            for address in self._resolved[target]:
                self._server_names[address] = target.host
        changes = self._apply(self._members())
        await self._on_changes(changes)
        return changes

    async def discover_forever(self) -> None:
        while True:
            await asyncio.sleep(self._config.resolve_interval_s)
            try:
                await self.discover()
            except Exception:  # a bug here must not stop discovery for good
                _LOG.exception("discovering instances failed")

    def collect_drained(self) -> None:
        """Drop the instances the router dropped once their last request finished."""
        for address in self._router.take_dropped():
            self._dropped(address)

    def channel(self, address: str, receive_window_bytes: int | None = None) -> grpc.aio.Channel:
        """The one channel to `address` (made on first use, closed by `close`)."""
        ch = self._channels.get(address)
        if ch is None:
            ch = channel(
                address,
                tls=self._tls,
                server_name=self._server_names.get(address),
                interceptors=self._interceptors,
                receive_window_bytes=receive_window_bytes,
            )
            self._channels[address] = ch
        return ch

    async def close(self) -> None:
        for multiplexer in self._multiplexers.values():
            await multiplexer.close()
        for ch in self._channels.values():
            await ch.close()

    async def _lookup(self, target: Target) -> tuple[str, ...] | None:
        try:
            ips = await self._resolve(target.host)
        except LookupFailed as e:
            self.lookup_problems.update(target, f"lookup failed (keeping its last answer): {e}")
            return None
        self.lookup_problems.update(target, None if ips else NO_ADDRESS)
        return ips

    def _members(self) -> dict[str, list[str]]:
        members: dict[str, list[str]] = {}
        for kind, targets in self._targets.items():
            addresses = (a for t in targets for a in self._resolved.get(t, ()))
            members[kind] = list(dict.fromkeys(addresses))
        return members

    def _apply(self, members: dict[str, list[str]]) -> MemberChanges:
        # First close what the router dropped since the last poll: an instance that drained
        # and is back in this answer is then added afresh, not given a stub that the next
        # collect_drained closes (leaving it routed to, never polled, DOWN for good).
        self.collect_drained()
        changes = self._router.set_members(members["prefill"], members["decode"])
        for address in changes.added:
            kind = "prefill" if address in self._router.prefills else "decode"
            self._add_stub(kind, address)
            self._count(kind, "added")
            if self._is_started:
                _LOG.info("%s at %s joined: checking its Info", kind, address)
        for address in changes.draining:
            kind = "prefill" if address in self._router.prefills else "decode"
            self._count(kind, "draining")
            num = (
                self._router.prefills.get(address) or self._router.decodes[address]
            ).num_in_flight
            _LOG.info(
                "%s at %s left: draining its %s in flight", kind, address, plural(num, "request")
            )
        for address in changes.returned:
            kind = "prefill" if address in self._router.prefills else "decode"
            self._count(kind, "returned")
            _LOG.info("%s at %s is back while draining: serving again", kind, address)
        for address in changes.dropped:
            self._dropped(address)
        return changes

    def _add_stub(self, kind: str, address: str) -> None:
        # Decode's GenerateStream carries every request's admissions and tokens in order: a
        # small window keeps a backlog at decode (merged per request) instead of in front of
        # the next admission here (docs/benchmarks.md, "Token path", TTFT).
        window = DECODE_RECEIVE_WINDOW_BYTES if kind == "decode" else None
        ch = self.channel(address, window)
        if kind == "prefill":
            self._prefills[address] = prefill_pb2_grpc.PrefillServiceStub(ch)
        else:
            stub = decode_pb2_grpc.DecodeServiceStub(ch)
            self._decodes[address] = stub
            self._multiplexers[address] = DecodeMultiplexer(stub, f"decode at {address}")

    def _dropped(self, address: str) -> None:
        """Forget an instance that left and has no request left on it."""
        kind = "prefill" if address in self._prefills else "decode"
        self._prefills.pop(address, None)
        self._decodes.pop(address, None)
        multiplexer = self._multiplexers.pop(address, None)
        if multiplexer is not None:  # no request is left on it
            closing = asyncio.ensure_future(multiplexer.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        self._on_dropped(address)
        self._count(kind, "dropped")
        _LOG.info("%s at %s left: dropped", kind, address)
        ch = self._channels.pop(address, None)
        if ch is not None:
            task = asyncio.ensure_future(ch.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _count(self, kind: str, change: str) -> None:
        if self._metrics is not None:
            self._metrics.instance_changes.labels(kind, change).inc()
