"""The frontend's view of the services behind it: the instances there are (instances.py:
targets, membership, a channel and stub each), their Info polled (poller.py: loads, KV layouts,
pair checks), the tokenizer (tokenizer_backend.py), and what follows from them.

Every `poll_interval_s` (and at once when a request saw an instance fail, or one joined) a
round of polls fetches each prefill and decode instance's Info and the tokenizer's concurrently.
The tokenizer's Info (vocabulary size, EOS ids) names a tokenizer file; when this frontend has
not loaded it, the file is fetched and loaded to detokenize here (text.py), and every pair is
checked again against it; the tokenizer counts as up only with its file loaded.

After each round the admission queue (admitter.py) is told room may have freed: the requests
waiting in it try again, and an instance that turned one away for room is asked again.

After each round `readiness` (readiness.py) is computed once, and both the frontend's
grpc.health.v1 status and HTTP /health follow it: SERVING while the tokenizer is up and at least
one prefill/decode pair is up with matching KV layouts, NOT_SERVING (with a warning saying what
is missing) otherwise, so a load balancer routes away from a frontend that could only fail
requests. Calls are still taken meanwhile and fail with the usual status. It is computed again
when membership changed after the first round: the last instance of a kind may have left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc

from mili.discovery import Resolve, resolve_host
from mili.pb.tokenizer.v1 import tokenizer_pb2_grpc
from mili.rpc.tls import Tls
from mili.telemetry.metrics import FrontendMetrics
from services.frontend.admission import AdmissionQueue
from services.frontend.admitter import Admitter
from services.frontend.calls import InstanceDown
from services.frontend.config import FrontendConfig
from services.frontend.instances import Instances
from services.frontend.poller import Poller
from services.frontend.readiness import NOT_POLLED, Readiness, readiness_of
from services.frontend.router import MemberChanges, Router
from services.frontend.tokenizer_backend import TokenizerBackend

_LOG = logging.getLogger("mili.frontend")


class Backends:
    """The instances behind the frontend, their Info poller feeding the router, the tokenizer
    and the admission queue, started and closed together."""

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
        self.poller = Poller(
            config,
            router,
            tokenizer_file=self._tokenizer_file,
            is_tls=tls is not None,
            on_down=self._stopped_answering,
        )
        self.prefill_layouts = self.poller.prefill_layouts  # as of each instance's last Info
        self.decode_layouts = self.poller.decode_layouts
        # Whether it can serve, as of the last round of polls (both health APIs read it).
        self.readiness: Readiness = NOT_POLLED
        self._is_health_reported = False
        self._wake: asyncio.Event | None = None
        self._polling: asyncio.Task[None] | None = None
        self._resolver: asyncio.Task[None] | None = None
        # prefill address -> its next outage's error, for the Prefill calls out on it to wait on
        self._outages: dict[str, asyncio.Future[InstanceDown]] = {}
        self.instances = Instances(
            config,
            router,
            on_changes=self._changed,
            on_dropped=self._dropped,
            interceptors=interceptors,
            tls=tls,
            metrics=metrics,
            resolve=resolve,
        )
        self.lookup_problems = self.instances.lookup_problems
        self.tokenizer = TokenizerBackend(
            config.tokenizer_address,
            tokenizer_pb2_grpc.TokenizerServiceStub(self.instances.tokenizer_channel),
            config.info_timeout_s,
            is_tls=tls is not None,
            applies_sampling_defaults=config.model_sampling_defaults,
        )
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

    async def start(self) -> None:
        """One round of lookups and Info polls (instances not up yet are found by later
        ones), then keep doing both."""
        self._wake = asyncio.Event()
        await self.instances.start()
        await self.refresh()
        missing = [a for a, v in self.router.prefills.items() if not v.is_up]
        missing += [a for a, v in self.router.decodes.items() if not v.is_up]
        if missing:
            _LOG.warning("not reachable yet (polling on): %s", ", ".join(missing))
        self._polling = asyncio.create_task(self._poll_forever())
        if self.instances.has_dns_targets:
            self._resolver = asyncio.create_task(self.instances.discover_forever())

    async def close(self) -> None:
        for task in (self._resolver, self._polling):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.instances.close()

    async def _changed(self, changes: MemberChanges) -> None:
        """After each round of lookups (Instances.discover)."""
        if changes.added and self._wake is not None:
            self._wake.set()  # poll the newcomers' Info now, not at the next interval
        if changes and self._is_health_reported:
            await self._report_health()  # the last instance of a kind may have left

    def _stopped_answering(self, kind: str, address: str, why: str) -> None:
        """The poller found an instance answering no Info for hung_after_s: a hung one
        (stopped, not dead) keeps its connection, so the calls out on it would wait for grpc's
        keepalive (or a KV lease) to fail them. They fail now, as from an instance down."""
        error = InstanceDown(f"{kind} at {address} stopped answering (its Info: {why})")
        # Once per outage (the poller calls this once until the instance answers again): the
        # requests cut here fail or move on now, and only this line says why.
        _LOG.warning("%s; cutting the calls still out on it", error)
        if kind == "decode":
            with contextlib.suppress(KeyError):  # dropped meanwhile
                self.instances.multiplexer(address).cut(error)
        else:
            outage = self._outages.pop(address, None)
            if outage is not None and not outage.done():
                outage.set_result(error)

    def outage(self, address: str) -> asyncio.Future[InstanceDown]:
        """Done, with the error to fail them with, when the poller next finds prefill instance
        `address` not answering: what its Prefill calls out wait on besides their answer."""
        outage = self._outages.get(address)
        if outage is None:
            outage = self._outages[address] = asyncio.get_running_loop().create_future()
        return outage

    def _dropped(self, address: str) -> None:
        self.poller.forget(address)
        self._outages.pop(address, None)

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
        """The model name the public APIs report: --served-model-name's first, else the
        tokenizer's (the instances' until it answered)."""
        if self.config.served_model_names:
            return self.config.served_model_names[0]
        if self.tokenizer.facts is not None:
            return self.tokenizer.facts.model
        return next(iter(self.poller.models.values()), "")

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the public APIs answer to, the reported one (`model`) first."""
        return self.config.served_model_names or (self.model,)

    def answers_to(self, name: str) -> bool:
        """Whether a request naming model `name` is for this deployment (any name, before
        the tokenizer or an instance said which model it is). A path or a hub id whose last
        part is a served name is one too: load generators name the model as vLLM serves it,
        by the --model they were given ("/models/Qwen3-0.6B", "Qwen/Qwen3-0.6B"), where the
        checkpoint's directory name is ours."""
        if not self.model or name in self.model_names:
            return True
        return "/" in name and name.rstrip("/").rsplit("/", 1)[-1] in self.model_names

    async def refresh(self) -> None:
        self.instances.collect_drained()
        polls = self.poller.polls(self.instances)
        polls.append(self.tokenizer.poll())
        await asyncio.gather(*polls)
        self.poller.check_tokenizer_file()
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

    def _tokenizer_file(self) -> str:
        facts = self.tokenizer.facts
        return "" if facts is None else facts.tokenizer_file_sha256
