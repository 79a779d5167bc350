"""The frontend's view of the services behind it: one channel per instance, and Info polling.

Every `poll_interval_s` (and at once when a request saw an instance fail) each prefill and
decode instance's Info is fetched concurrently:

    answered   -> router.update_*(load), its KV layout stored, and every pair it forms with the
                  other side re-checked with kv_layout.check_compatible (a mismatch is logged
                  loudly and the pair is never routed; a fixed one becomes routable again)
    no answer  -> router.mark_down: routed around until it answers again

The tokenizer's Info (vocabulary size, EOS ids) is polled with them; when it names a tokenizer
file this frontend has not loaded, the file is fetched and loaded to detokenize here (text.py).

After each round the frontend's grpc.health.v1 status follows: SERVING while the tokenizer is
up and at least one prefill/decode pair is up with matching KV layouts, NOT_SERVING (with a
warning saying what is missing) otherwise, so a load balancer routes away from a frontend that
could only fail requests. Calls are still taken meanwhile and fail with the usual status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc

from mili.decode.v1 import decode_pb2, decode_pb2_grpc
from mili.errors import FailedPrecondition
from mili.kv.v1 import kv_pb2
from mili.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from mili.rpc.client import insecure_channel
from mili.rpc.kv_layout import check_compatible, describe
from mili.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.frontend.calls import TokenizerFacts
from services.frontend.config import FrontendConfig
from services.frontend.downstream import error_from
from services.frontend.multiplex import DecodeMultiplexer
from services.frontend.router import Router
from services.frontend.text import LocalDetokenizer

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
    ) -> None:
        """`on_health(is_serving)` is awaited whenever usability changes (and after the first
        round), e.g. RpcServer.set_serving."""
        self.config = config
        self.router = router
        self._on_health = on_health
        addresses = [config.tokenizer_address, *config.prefill_addresses, *config.decode_addresses]
        self._channels = {
            a: insecure_channel(a, interceptors=interceptors) for a in dict.fromkeys(addresses)
        }
        self.tokenizer = tokenizer_pb2_grpc.TokenizerServiceStub(
            self._channels[config.tokenizer_address]
        )
        self._prefills = {
            a: prefill_pb2_grpc.PrefillServiceStub(self._channels[a])
            for a in config.prefill_addresses
        }
        self._decodes = {
            a: decode_pb2_grpc.DecodeServiceStub(self._channels[a]) for a in config.decode_addresses
        }
        # Every request on a decode instance shares one GenerateStream (multiplex.py).
        self._multiplexers = {
            a: DecodeMultiplexer(stub, f"decode at {a}") for a, stub in self._decodes.items()
        }
        self.prefill_layouts: dict[str, kv_pb2.KvLayout] = {}
        self.decode_layouts: dict[str, kv_pb2.KvLayout] = {}
        self.models: dict[str, str] = {}  # address -> model name its Info reported
        self._tokenizer_facts: TokenizerFacts | None = None  # None: down, or not asked yet
        # The tokenizer's file, loaded to detokenize here; None: detokenize through the service.
        self.local_detokenizer: LocalDetokenizer | None = None
        self._problem: str | None = None  # why it is not usable; None when it is
        self._is_health_reported = False
        self._wake: asyncio.Event | None = None
        self._poller: asyncio.Task[None] | None = None

    def prefill(self, address: str) -> prefill_pb2_grpc.PrefillServiceStub:
        return self._prefills[address]

    def decode(self, address: str) -> decode_pb2_grpc.DecodeServiceStub:
        return self._decodes[address]

    def multiplexer(self, address: str) -> DecodeMultiplexer:
        return self._multiplexers[address]

    async def start(self) -> None:
        """One round of discovery (instances not up yet are found by later polls), then poll."""
        self._wake = asyncio.Event()
        await self.refresh()
        missing = [a for a, v in self.router.prefills.items() if not v.is_up]
        missing += [a for a, v in self.router.decodes.items() if not v.is_up]
        if missing:
            _LOG.warning("not reachable yet (polling on): %s", ", ".join(missing))
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for multiplexer in self._multiplexers.values():
            await multiplexer.close()
        for channel in self._channels.values():
            await channel.close()

    def request_refresh(self, down: str | None = None) -> None:
        """An instance failed a request: route around it now and re-poll soon."""
        if down is not None:
            with contextlib.suppress(KeyError):
                self.router.mark_down(down)
        if self._wake is not None:
            self._wake.set()

    async def tokenizer_facts(self) -> TokenizerFacts:
        """The tokenizer's vocabulary size and EOS ids; raises Unavailable when it is down."""
        if self._tokenizer_facts is None:
            await self._fetch_tokenizer_facts()
            assert self._tokenizer_facts is not None
        return self._tokenizer_facts

    async def _fetch_tokenizer_facts(self) -> None:
        who = f"tokenizer at {self.config.tokenizer_address}"
        try:
            info = await self.tokenizer.Info(
                tokenizer_pb2.InfoRequest(), timeout=self.config.info_timeout_s
            )
        except grpc.aio.AioRpcError as err:
            if self._tokenizer_facts is not None:
                _LOG.warning("%s is down: %s: %s", who, err.code().name, err.details())
            self._tokenizer_facts = None
            raise error_from(err, who) from None
        facts = TokenizerFacts(
            model=info.model,
            vocab_size=info.vocab_size,
            eos_token_ids=tuple(info.eos_token_ids),
            max_input_chars=info.max_input_chars,
            tokenizer_file_sha256=info.tokenizer_file_sha256,
        )
        if facts != self._tokenizer_facts:
            _LOG.info(
                "%s is up: model %s, vocab %d, eos %s",
                who,
                info.model,
                info.vocab_size,
                list(info.eos_token_ids),
            )
        self._tokenizer_facts = facts

    def forget_tokenizer(self) -> None:
        """The tokenizer failed: fetch its Info again next time (it may have restarted)."""
        self._tokenizer_facts = None
        self.request_refresh()

    @property
    def problem(self) -> str | None:
        """Why this frontend cannot serve a request (as of the last poll); None when it can."""
        return self._problem

    @property
    def model(self) -> str:
        if self._tokenizer_facts is not None:
            return self._tokenizer_facts.model
        return next(iter(self.models.values()), "")

    # ---- polling -----------------------------------------------------------------------------

    async def refresh(self) -> None:
        polls = [self._poll_prefill(a) for a in self._prefills]
        polls += [self._poll_decode(a) for a in self._decodes]
        polls.append(self._poll_tokenizer())
        await asyncio.gather(*polls)
        await self._report_health()

    async def _report_health(self) -> None:
        problem: str | None
        if self._tokenizer_facts is None:
            problem = f"the tokenizer at {self.config.tokenizer_address} is down"
        else:
            problem = self.router.route_problem()
        if self._is_health_reported and problem == self._problem:
            return
        self._problem = problem
        self._is_health_reported = True
        if problem is None:
            _LOG.info("health SERVING: the tokenizer and a prefill/decode pair are up")
        else:
            _LOG.warning("health NOT_SERVING: %s", problem)
        if self._on_health is not None:
            await self._on_health(problem is None)

    async def _poll_forever(self) -> None:
        assert self._wake is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.poll_interval_s)
            self._wake.clear()
            try:
                await self.refresh()
            except Exception:  # a bug here must not stop routing updates for good
                _LOG.exception("polling instance Info failed")

    async def _poll_tokenizer(self) -> None:
        with contextlib.suppress(Exception):
            await self._fetch_tokenizer_facts()
            await self._sync_detokenizer()

    async def _sync_detokenizer(self) -> None:
        """Load the tokenizer's file for detokenizing in this process (text.py) when its digest
        is new; without one (a tokenizer that does not hand it out), detokenize through it."""
        facts = self._tokenizer_facts
        sha256 = "" if facts is None else facts.tokenizer_file_sha256
        if not sha256:
            self.local_detokenizer = None
            return
        if self.local_detokenizer is not None and self.local_detokenizer.sha256 == sha256:
            return
        who = f"tokenizer at {self.config.tokenizer_address}"
        try:
            reply = await self.tokenizer.GetTokenizerFile(
                tokenizer_pb2.GetTokenizerFileRequest(), timeout=self.config.info_timeout_s * 10
            )
            # Parsing a 150k-token vocabulary takes most of a second: off the event loop.
            local = await asyncio.to_thread(LocalDetokenizer, reply.tokenizer_json, reply.sha256)
        except (grpc.aio.AioRpcError, ValueError) as err:
            self.local_detokenizer = None
            why = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.RpcError) else err
            _LOG.warning("%s: no tokenizer file (%s); detokenizing through it", who, why)
            return
        self.local_detokenizer = local
        _LOG.info("detokenizing in process with the tokenizer file of %s (%s)", who, sha256[:12])

    async def _poll_prefill(self, address: str) -> None:
        try:
            info = await self._prefills[address].Info(
                prefill_pb2.InfoRequest(), timeout=self.config.info_timeout_s
            )
        except grpc.aio.AioRpcError as err:
            self._went_down("prefill", address, self.router.prefills[address].is_up, err)
            return
        was_up = self.router.prefills[address].is_up
        self.prefill_layouts[address] = info.kv_layout
        self.models[address] = info.model
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
            self._went_down("decode", address, self.router.decodes[address].is_up, err)
            return
        was_up = self.router.decodes[address].is_up
        self.decode_layouts[address] = info.kv_layout
        self.models[address] = info.model
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

    def _went_down(self, kind: str, address: str, was_up: bool, err: grpc.aio.AioRpcError) -> None:
        self.router.mark_down(address)
        if was_up:
            _LOG.warning("%s at %s is down: %s: %s", kind, address, err.code().name, err.details())

    def _check_pairs(self, *, prefills: list[str], decodes: list[str]) -> None:
        for p in prefills:
            for d in decodes:
                if p not in self.prefill_layouts or d not in self.decode_layouts:
                    continue
                try:
                    check_compatible(
                        self.prefill_layouts[p],
                        self.decode_layouts[d],
                        local_name=f"prefill at {p}",
                        remote_name=f"decode at {d}",
                    )
                    error = None
                except FailedPrecondition as exc:
                    error = str(exc)
                before = self.router.pair_error(p, d)
                if error is not None and error != before:
                    _LOG.error("REFUSING PAIR prefill %s -> decode %s: %s", p, d, error)
                elif error is None and before is not None:
                    _LOG.info("prefill %s -> decode %s: KV layouts now match", p, d)
                self.router.set_pair_error(p, d, error)
