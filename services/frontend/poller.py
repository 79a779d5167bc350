"""Each prefill and decode instance's Info, polled, and the pairs they form checked.

One round (`polls`, every `poll_interval_s` and at once when a request saw an instance fail or
one joined; backends.py runs it) fetches every instance's Info concurrently:

    answered   -> router.update_*(load), its KV layout and tokenizer file stored, and every pair
                  it forms with the other side re-checked (pairing.py: KV layouts, tokenizer;
                  a refused pair is logged loudly and never routed; a fixed one becomes
                  routable again)
    no answer  -> router.mark_down: routed around until it answers again; once it has not
                  answered for hung_after_s (several polls), `on_down(kind, address, why)` too:
                  the calls still out on it will not be answered either (backends.py cuts them)

The tokenizer's Info is polled alongside (backends.py); when it names a new tokenizer file every
pair is checked again against it (`check_tokenizer_file`). What an instance's Info said is
forgotten when it is dropped (Instances calls `forget`). Each instance's first failure to answer
is logged with its reason once (a TLS handshake refused, say), not at every poll.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine

import grpc

from mili.pb.decode.v1 import decode_pb2
from mili.pb.kv.v1 import kv_pb2
from mili.pb.prefill.v1 import prefill_pb2
from mili.rpc.client import connection_hint
from mili.rpc.kv_layout import describe
from services.frontend.config import FrontendConfig
from services.frontend.instances import Instances
from services.frontend.pairing import Side, pair_error
from services.frontend.router import Router

_LOG = logging.getLogger("mili.frontend")


class Poller:
    """What every instance's Info said last, and the router kept up to date with it."""

    def __init__(
        self,
        config: FrontendConfig,
        router: Router,
        *,
        tokenizer_file: Callable[[], str],
        is_tls: bool,
        on_down: Callable[[str, str, str], None] | None = None,
    ) -> None:
        """`tokenizer_file()`: the sha256 of the tokenizer service's file ("" while unknown),
        that every pair is checked against. `is_tls`: whether the instances are dialed over
        TLS (for the hint in a failure's warning). `on_down(kind, address, why)`: an instance
        stopped answering its Info (called once per outage, when it is logged)."""
        self._config = config
        self._on_down = on_down
        self._router = router
        self._tokenizer_file = tokenizer_file
        self._is_tls = is_tls
        self._unreachable: set[str] = set()  # instances whose failure to answer was logged
        self._answered_at: dict[str, float] = {}  # each instance's last Info answer
        self._hung: set[str] = set()  # instances on_down was called for since they answered
        self.prefill_layouts: dict[str, kv_pb2.KvLayout] = {}
        self.decode_layouts: dict[str, kv_pb2.KvLayout] = {}
        self.models: dict[str, str] = {}  # address -> model name its Info reported
        self.tokenizer_files: dict[str, str] = {}  # address -> its tokenizer.json's sha256
        self._paired_tokenizer_file = ""  # the tokenizer's file the pairs were checked with

    def polls(self, instances: Instances) -> list[Coroutine[None, None, None]]:
        """One round: every instance's Info poll, to be awaited together (with the
        tokenizer's). `instances` comes with each round, not to the constructor: they tell
        this poller of drops, so it is made first."""
        polls = [self._poll_prefill(instances, a) for a in instances.addresses("prefill")]
        polls += [self._poll_decode(instances, a) for a in instances.addresses("decode")]
        return polls

    def check_tokenizer_file(self) -> None:
        """Check every pair again if the tokenizer's file changed since they were checked."""
        if self._tokenizer_file() != self._paired_tokenizer_file:  # a new (or first) file
            self._check_pairs(
                prefills=list(self.prefill_layouts), decodes=list(self.decode_layouts)
            )

    def forget(self, address: str) -> None:
        """What the Info of an instance just dropped said."""
        self.prefill_layouts.pop(address, None)
        self.decode_layouts.pop(address, None)
        self.models.pop(address, None)
        self.tokenizer_files.pop(address, None)
        self._unreachable.discard(address)
        self._answered_at.pop(address, None)
        self._hung.discard(address)

    async def _poll_prefill(self, instances: Instances, address: str) -> None:
        try:
            info = await instances.prefill(address).Info(
                prefill_pb2.InfoRequest(), timeout=self._config.info_timeout_s
            )
        except grpc.aio.AioRpcError as err:
            self._went_down("prefill", address, err)
            return
        was_up = self._answered("prefill", address, info)
        if was_up is None:
            return  # dropped while the call was out
        self._router.update_prefill(
            address,
            num_queued_tokens=info.num_queued_tokens,
            max_prompt_tokens=info.max_prompt_tokens,
            caches_prefixes=info.prefix_cache.enabled,
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

    async def _poll_decode(self, instances: Instances, address: str) -> None:
        try:
            info = await instances.decode(address).Info(
                decode_pb2.InfoRequest(), timeout=self._config.info_timeout_s
            )
        except grpc.aio.AioRpcError as err:
            self._went_down("decode", address, err)
            return
        was_up = self._answered("decode", address, info)
        if was_up is None:
            return
        self._router.update_decode(
            address,
            num_free_blocks=info.num_free_blocks,
            num_total_blocks=info.num_total_blocks,
            max_context_tokens=info.max_context_tokens,
            caches_prefixes=info.prefix_cache.enabled,
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

    def _answered(
        self, kind: str, address: str, info: prefill_pb2.InfoResponse | decode_pb2.InfoResponse
    ) -> bool | None:
        """Keep what an instance's Info says and check its pairs; whether it was up before
        (None: dropped while the call was out). The caller updates the router right after,
        with no await between: the router never sees the instance up with unchecked pairs."""
        view = (self._router.prefills if kind == "prefill" else self._router.decodes).get(address)
        if view is None:
            return None
        was_up = view.is_up
        self._unreachable.discard(address)
        self._answered_at[address] = time.monotonic()
        self._hung.discard(address)
        self.models[address] = info.model
        self.tokenizer_files[address] = info.tokenizer_file_sha256
        if kind == "prefill":
            self.prefill_layouts[address] = info.kv_layout
            self._check_pairs(prefills=[address], decodes=list(self.decode_layouts))
        else:
            self.decode_layouts[address] = info.kv_layout
            self._check_pairs(prefills=list(self.prefill_layouts), decodes=[address])
        return was_up

    def _went_down(self, kind: str, address: str, err: grpc.aio.AioRpcError) -> None:
        views = self._router.prefills if kind == "prefill" else self._router.decodes
        view = views.get(address)
        if view is None:
            return
        was_up = view.is_up
        self._router.mark_down(address)
        # Once per outage (not at every poll): a refused TLS handshake repeats forever.
        if was_up or address not in self._unreachable:
            self._unreachable.add(address)
            what = "is down" if was_up else "does not answer"
            hint = connection_hint(err, is_tls=self._is_tls)
            _LOG.warning(
                "%s at %s %s: %s: %s%s", kind, address, what, err.code().name, err.details(), hint
            )
        answered_at = self._answered_at.get(address)
        if (
            self._on_down is not None
            and answered_at is not None
            and time.monotonic() - answered_at >= self._config.hung_after_s
            and address not in self._hung
        ):
            self._hung.add(address)
            silent_s = time.monotonic() - answered_at
            self._on_down(
                kind, address, f"none for {silent_s:.0f} s, last {err.code().name}: {err.details()}"
            )

    def _check_pairs(self, *, prefills: list[str], decodes: list[str]) -> None:
        tokenizer_file = self._paired_tokenizer_file = self._tokenizer_file()
        tokenizer_name = f"tokenizer service at {self._config.tokenizer_address}"
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
                before = self._router.pair_error(p, d)
                if error is not None and error != before:
                    _LOG.error("REFUSING PAIR prefill %s -> decode %s: %s", p, d, error)
                elif error is None and before is not None:
                    _LOG.info("prefill %s -> decode %s: now compatible", p, d)
                self._router.set_pair_error(p, d, error)
