"""The frontend's view of the services behind it: one channel per instance, and Info polling.

Every `poll_interval_s` (and at once when a request saw an instance fail) each prefill and
decode instance's Info is fetched concurrently:

    answered   -> router.update_*(load), its KV layout and tokenizer file stored, and every pair
                  it forms with the other side re-checked (pairing.py: KV layouts, tokenizer;
                  a refused pair is logged loudly and never routed; a fixed one becomes
                  routable again)
    no answer  -> router.mark_down: routed around until it answers again

The tokenizer's Info (vocabulary size, EOS ids) is polled with them; when it names a tokenizer
file this frontend has not loaded, the file is fetched and loaded to detokenize here (text.py),
and every pair is checked again against it; the tokenizer counts as up only with its file
loaded.

Membership: `--prefill` / `--decode` targets are fixed addresses or `dns:///NAME:PORT` names
(mili.discovery). Every `resolve_interval_s` each name is looked up again and the router told
the instances there are now (Router.set_members): a new one gets a channel and an Info poll at
once, and is routed once that Info answered and its layouts checked out; a vanished one drains
(its requests in flight finish there) and its channel is closed once it is dropped. A failed
lookup keeps what the name resolved to before: a resolver hiccup must not drain every instance.
A name that resolves to no address or fails its lookup is logged once (and again when that
changes) and listed in Info's target_problems until it resolves.
Each instance's first failure to answer is logged with its reason once (a TLS handshake
refused, say), not at every poll.

After each round the admission queue (admitter.py) is told room may have freed: the requests
waiting in it try again, and an instance that turned one away for room is asked again.

After each round `readiness` (readiness.py) is computed once, and both the frontend's
grpc.health.v1 status and HTTP /health follow it: SERVING while the tokenizer is up and at least
one prefill/decode pair is up with matching KV layouts, NOT_SERVING (with a warning saying what
is missing) otherwise, so a load balancer routes away from a frontend that could only fail
requests. Calls are still taken meanwhile and fail with the usual status.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from mili.pb.decode.v1 import decode_pb2, decode_pb2_grpc
from mili.pb.kv.v1 import kv_pb2
from mili.pb.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from mili.pb.tokenizer.v1 import tokenizer_pb2_grpc
from mili.rpc.client import channel, connection_hint
from mili.rpc.kv_layout import describe
from mili.rpc.tls import Tls
from mili.telemetry.metrics import FrontendMetrics
from services.frontend.admission import AdmissionQueue
from services.frontend.admitter import Admitter
from services.frontend.config import FrontendConfig
from services.frontend.multiplex import DecodeMultiplexer
from services.frontend.pairing import Side, pair_error
from services.frontend.readiness import NOT_POLLED, Readiness, readiness_of
from services.frontend.router import MemberChanges, Router
from services.frontend.tokenizer_backend import TokenizerBackend

_LOG = logging.getLogger("mili.frontend")


class Backends:
    """Channels and stubs to every downstream instance, and the poller feeding the router."""

    def __init__(
        self,
        config: FrontendConfig,
        router: Router,
        *,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        on_health: Callable[[bool], Awaitable[None]] | None = None,
        tls: Tls | None = None,
        metrics: FrontendMetrics | None = None,
        resolve: Resolve = resolve_host,
    ) -> None:
        """`on_health(is_serving)` is awaited whenever usability changes (and after the first
        round), e.g. RpcServer.set_serving. `tls`: dial every service over TLS with these
        certificates. `resolve`: the DNS lookup (tests pass their own)."""
        self.config = config
        self.router = router
        self._on_health = on_health
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
        self._unreachable: set[str] = set()  # instances whose failure to answer was logged
        self.lookup_problems = LookupProblems(_LOG)  # names whose last lookup went wrong
        self.tokenizer = TokenizerBackend(
            config.tokenizer_address,
            tokenizer_pb2_grpc.TokenizerServiceStub(self._channel(config.tokenizer_address)),
            config.info_timeout_s,
        )
        # Every request on a decode instance shares one GenerateStream (multiplex.py).
        self._multiplexers: dict[str, DecodeMultiplexer] = {}
        # Requests that found every instance full wait here for room.
        self.admitter = Admitter(
            AdmissionQueue(
                config.max_queued_requests,
                config.max_queued_tokens,
                retry_after_s=config.retry_after_s,
            )
        )
        if metrics is not None:
            metrics.watch_queue(
                num_requests=lambda: self.admitter.num_waiting,
                num_tokens=lambda: self.admitter.num_waiting_tokens,
            )
            self.admitter.on_wait = metrics.queue_wait.observe
        self.prefill_layouts: dict[str, kv_pb2.KvLayout] = {}
        self.decode_layouts: dict[str, kv_pb2.KvLayout] = {}
        self.models: dict[str, str] = {}  # address -> model name its Info reported
        self.tokenizer_files: dict[str, str] = {}  # address -> its tokenizer.json's sha256
        self._paired_tokenizer_file = ""  # the tokenizer's file the pairs were checked with
        # Whether it can serve, as of the last round of polls (both health APIs read it).
        self.readiness: Readiness = NOT_POLLED
        self._is_health_reported = False
        self._wake: asyncio.Event | None = None
        self._closing: set[asyncio.Future[None]] = set()  # channels of dropped instances
        self._poller: asyncio.Task[None] | None = None
        self._resolver: asyncio.Task[None] | None = None
        for address in router.prefills:  # members the router came with
            self._add_stub("prefill", address)
        for address in router.decodes:
            self._add_stub("decode", address)
        self._apply(self._members())  # the fixed addresses, known before any lookup

    def prefill(self, address: str) -> prefill_pb2_grpc.PrefillServiceStub:
        return self._prefills[address]

    def decode(self, address: str) -> decode_pb2_grpc.DecodeServiceStub:
        return self._decodes[address]

    def targets(self, kind: str) -> tuple[Target, ...]:
        """The --prefill or --decode targets, as configured."""
        return self._targets[kind]

    def target_of(self, address: str) -> str:
        """The target (as configured) that instance `address` came from."""
        for target, addresses in self._resolved.items():
            if address in addresses:
                return target.spec
        return address  # it left every target's answer and is draining

    def multiplexer(self, address: str) -> DecodeMultiplexer:
        return self._multiplexers[address]

    async def start(self) -> None:
        """One round of lookups and Info polls (instances not up yet are found by later
        ones), then keep doing both."""
        self._wake = asyncio.Event()
        await self.discover()
        await self.refresh()
        missing = [a for a, v in self.router.prefills.items() if not v.is_up]
        missing += [a for a, v in self.router.decodes.items() if not v.is_up]
        if missing:
            _LOG.warning("not reachable yet (polling on): %s", ", ".join(missing))
        self._poller = asyncio.create_task(self._poll_forever())
        if any(t.is_dns for targets in self._targets.values() for t in targets):
            self._resolver = asyncio.create_task(self._discover_forever())

    async def close(self) -> None:
        for task in (self._resolver, self._poller):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for multiplexer in self._multiplexers.values():
            await multiplexer.close()
        for ch in self._channels.values():
            await ch.close()

    # ---- membership --------------------------------------------------------------------------

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
        if changes.added and self._wake is not None:
            self._wake.set()  # poll the newcomers' Info now, not at the next interval
        if changes and self._is_health_reported:
            await self._report_health()  # the last instance of a kind may have left
        return changes

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
        changes = self.router.set_members(members["prefill"], members["decode"])
        for address in changes.added:
            kind = "prefill" if address in self.router.prefills else "decode"
            self._add_stub(kind, address)
            self._count(kind, "added")
            if self._is_started:
                _LOG.info("%s at %s joined: checking its Info", kind, address)
        for address in changes.draining:
            kind = "prefill" if address in self.router.prefills else "decode"
            self._count(kind, "draining")
            num = (self.router.prefills.get(address) or self.router.decodes[address]).num_in_flight
            _LOG.info("%s at %s left: draining its %d requests in flight", kind, address, num)
        for address in changes.returned:
            kind = "prefill" if address in self.router.prefills else "decode"
            self._count(kind, "returned")
            _LOG.info("%s at %s is back while draining: serving again", kind, address)
        for address in changes.dropped:
            self._dropped(address)
        return changes

    def _add_stub(self, kind: str, address: str) -> None:
        # Decode's GenerateStream carries every request's admissions and tokens in order: a
        # small window keeps a backlog at decode (merged per request) instead of in front of
        # the next admission here (docs/benchmarks.md, "Token path", TTFT).
        window = self.config.decode_receive_window_bytes if kind == "decode" else None
        ch = self._channel(address, window)
        if kind == "prefill":
            self._prefills[address] = prefill_pb2_grpc.PrefillServiceStub(ch)
        else:
            stub = decode_pb2_grpc.DecodeServiceStub(ch)
            self._decodes[address] = stub
            self._multiplexers[address] = DecodeMultiplexer(stub, f"decode at {address}")

    @property
    def _is_started(self) -> bool:
        return self._wake is not None

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
        self.prefill_layouts.pop(address, None)
        self.decode_layouts.pop(address, None)
        self.models.pop(address, None)
        self.tokenizer_files.pop(address, None)
        self._unreachable.discard(address)
        self._count(kind, "dropped")
        _LOG.info("%s at %s left: dropped", kind, address)
        ch = self._channels.pop(address, None)
        if ch is not None:
            task = asyncio.ensure_future(ch.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _collect_drained(self) -> None:
        for address in self.router.take_dropped():
            self._dropped(address)

    def _count(self, kind: str, change: str) -> None:
        if self._metrics is not None:
            self._metrics.instance_changes.labels(kind, change).inc()

    def _channel(self, address: str, receive_window_bytes: int | None = None) -> grpc.aio.Channel:
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

    async def _discover_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.resolve_interval_s)
            try:
                await self.discover()
            except Exception:  # a bug here must not stop discovery for good
                _LOG.exception("discovering instances failed")

    def request_refresh(self, down: str | None = None) -> None:
        """An instance failed a request: route around it now and re-poll soon."""
        if down is not None:
            with contextlib.suppress(KeyError):
                self.router.mark_down(down)
        if self._wake is not None:
            self._wake.set()

    def forget_tokenizer(self) -> None:
        """The tokenizer failed: fetch its Info again soon (it may have restarted)."""
        self.tokenizer.forget()
        self.request_refresh()

    @property
    def problem(self) -> str | None:
        """Why this frontend cannot serve a request (as of the last poll); None when it can."""
        return self.readiness.problem

    @property
    def model(self) -> str:
        if self.tokenizer.facts is not None:
            return self.tokenizer.facts.model
        return next(iter(self.models.values()), "")

    # ---- polling -----------------------------------------------------------------------------

    async def refresh(self) -> None:
        self._collect_drained()
        polls = [self._poll_prefill(a) for a in list(self._prefills)]
        polls += [self._poll_decode(a) for a in list(self._decodes)]
        polls.append(self.tokenizer.poll())
        await asyncio.gather(*polls)
        if self._tokenizer_file() != self._paired_tokenizer_file:  # a new (or first) file
            self._check_pairs(
                prefills=list(self.prefill_layouts), decodes=list(self.decode_layouts)
            )
        self.admitter.notify()  # the polled instances may have room
        await self._report_health()

    async def _report_health(self) -> None:
        before, self.readiness = (
            self.readiness,
            readiness_of(
                self.router,
                is_tokenizer_up=self.tokenizer.facts is not None,
                tokenizer_address=self.config.tokenizer_address,
            ),
        )
        problem = self.readiness.problem
        if self._is_health_reported and problem == before.problem:
            return
        self._is_health_reported = True
        if problem is None:
            _LOG.info("health SERVING: the tokenizer and a prefill/decode pair are up")
        else:
            _LOG.warning("health NOT_SERVING: %s", problem)
        if self._on_health is not None:
            await self._on_health(self.readiness.is_serving)

    async def _poll_forever(self) -> None:
        assert self._wake is not None
        while True:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancel that lands
            # as the wake-up does, and close() then waits on this loop forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.poll_interval_s):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.refresh()
            except Exception:  # a bug here must not stop routing updates for good
                _LOG.exception("polling instance Info failed")

    async def _poll_prefill(self, address: str) -> None:
        try:
            info = await self._prefills[address].Info(
                prefill_pb2.InfoRequest(), timeout=self.config.info_timeout_s
            )
        except grpc.aio.AioRpcError as err:
            self._went_down("prefill", address, err)
            return
        view = self.router.prefills.get(address)
        if view is None:
            return  # dropped while the call was out
        was_up = view.is_up
        self._unreachable.discard(address)
        self.prefill_layouts[address] = info.kv_layout
        self.models[address] = info.model
        self.tokenizer_files[address] = info.tokenizer_file_sha256
        # No await from here on: the router never sees the instance up with unchecked pairs.
        self._check_pairs(prefills=[address], decodes=list(self.decode_layouts))
        self.router.update_prefill(
            address,
            num_queued_tokens=info.num_queued_tokens,
            max_prompt_tokens=info.max_prompt_tokens,
        )
        if not was_up:
            _LOG.info(
                "prefill at %s is up: model %s on %s (%s), %d/%d KV blocks free, layout [%s]",
                address,
                info.model,
                info.device,
                info.attention_backend,
                info.num_free_blocks,
                info.num_total_blocks,
                describe(info.kv_layout),
            )

    async def _poll_decode(self, address: str) -> None:
        try:
            info = await self._decodes[address].Info(
                decode_pb2.InfoRequest(), timeout=self.config.info_timeout_s
            )
        except grpc.aio.AioRpcError as err:
            self._went_down("decode", address, err)
            return
        view = self.router.decodes.get(address)
        if view is None:
            return
        was_up = view.is_up
        self._unreachable.discard(address)
        self.decode_layouts[address] = info.kv_layout
        self.models[address] = info.model
        self.tokenizer_files[address] = info.tokenizer_file_sha256
        self._check_pairs(prefills=list(self.prefill_layouts), decodes=[address])
        self.router.update_decode(
            address,
            num_free_blocks=info.num_free_blocks,
            num_total_blocks=info.num_total_blocks,
            max_context_tokens=info.max_context_tokens,
        )
        if not was_up:
            _LOG.info(
                "decode at %s is up: model %s on %s (%s), %d/%d KV blocks free, context %d, "
                "layout [%s]",
                address,
                info.model,
                info.device,
                info.attention_backend,
                info.num_free_blocks,
                info.num_total_blocks,
                info.max_context_tokens,
                describe(info.kv_layout),
            )

    def _went_down(self, kind: str, address: str, err: grpc.aio.AioRpcError) -> None:
        views = self.router.prefills if kind == "prefill" else self.router.decodes
        view = views.get(address)
        if view is None:
            return
        was_up = view.is_up
        self.router.mark_down(address)
        # Once per outage (not at every poll): a refused TLS handshake repeats forever.
        if was_up or address not in self._unreachable:
            self._unreachable.add(address)
            what = "is down" if was_up else "does not answer"
            hint = connection_hint(err, is_tls=self._tls is not None)
            _LOG.warning(
                "%s at %s %s: %s: %s%s", kind, address, what, err.code().name, err.details(), hint
            )

    def _tokenizer_file(self) -> str:
        facts = self.tokenizer.facts
        return "" if facts is None else facts.tokenizer_file_sha256

    def _check_pairs(self, *, prefills: list[str], decodes: list[str]) -> None:
        tokenizer_file = self._paired_tokenizer_file = self._tokenizer_file()
        tokenizer_name = f"tokenizer service at {self.config.tokenizer_address}"
        for p in prefills:
            for d in decodes:
                if p not in self.prefill_layouts or d not in self.decode_layouts:
                    continue
                error = pair_error(
                    Side(f"prefill at {p}", self.prefill_layouts[p], self.tokenizer_files[p]),
                    Side(f"decode at {d}", self.decode_layouts[d], self.tokenizer_files[d]),
                    tokenizer_file_sha256=tokenizer_file,
                    tokenizer_name=tokenizer_name,
                )
                before = self.router.pair_error(p, d)
                if error is not None and error != before:
                    _LOG.error("REFUSING PAIR prefill %s -> decode %s: %s", p, d, error)
                elif error is None and before is not None:
                    _LOG.info("prefill %s -> decode %s: now compatible", p, d)
                self.router.set_pair_error(p, d, error)
