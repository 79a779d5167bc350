"""Prefill's side of KV pairs: one channel per decode address, and the transport its KV bytes
take there, chosen once with decode's KvTransferService.Pair (mili.kv_handoff.transport).

    first transfer to an address ─▶ Pair(host id, device, transports, layout)
                                 ◀─ transport (+ where decode's pool is: shm path, CUDA IPC)
    in place: decode's pool is mapped once here and kept for every later transfer

A transfer that fails with decode gone (UNAVAILABLE) `forget`s the pair: the mapping is
dropped, MILI segments whose owner died are unlinked (a killed decode leaves none behind), and
the next transfer pairs again (a restarted decode has a new segment).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import grpc
import torch

from mili.errors import FailedPrecondition
from mili.kv_handoff import checksums
from mili.kv_handoff.kv_transport import GRPC, Endpoint
from mili.kv_handoff.shm_segment import sweep_stale
from mili.kv_handoff.transport import GrpcTransport, KvTransport, connect
from mili.pb.kv.v1 import kv_pb2
from mili.rpc.client import channel as make_channel
from mili.rpc.tls import Tls

_LOG = logging.getLogger("mili.prefill")
_SERVICE = kv_pb2.DESCRIPTOR.services_by_name["KvTransferService"].full_name
_PAIR = f"/{_SERVICE}/Pair"
_PAIR_TIMEOUT_S = 5.0
# How long a transfer waits for its channel to (re)connect: past grpc's reconnect backoff
# (capped at 2 s, +20% jitter, mili.rpc.client). Decode admitted the request moments ago, so it
# is up; a channel still backing off from its last run (a restarted decode) would otherwise fail
# the transfer at once.
_READY_WAIT_S = 3.0
_SWEEP_INTERVAL_S = 1.0  # how soon a decode killed between transfers loses its segment


class Pairing(NamedTuple):
    """A pair's transport, held for every transfer to its decode, and the checksum its chunks
    carry (mili.kv_handoff.checksums)."""

    kv: KvTransport
    checksum: str = checksums.CRC32

    @property
    def transport(self) -> str:
        return self.kv.name


GRPC_PAIRING = Pairing(GrpcTransport())


class Peers:
    """One channel and one pairing per decode address, shared by every transfer to it (one
    HTTP/2 connection, reconnected by grpc when it drops). With `tls`, channels are TLS and
    present our certificate; `server_name(address)` gives the name to verify decode's
    certificate against (the DNS name an instance was found by; None: the address's host)."""

    def __init__(
        self,
        max_message_bytes: int,
        *,
        largest_message_bytes: int = 0,
        endpoint: Endpoint | None = None,
        layout: kv_pb2.KvLayout | None = None,
        dtype: torch.dtype = torch.float32,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        tls: Tls | None = None,
        server_name: Callable[[str], str | None] = lambda address: None,
    ) -> None:
        self._max_message_bytes = max_message_bytes
        self._largest_message_bytes = largest_message_bytes  # of a TransferKv chunk with its KV
        self._interceptors = list(interceptors)  # tracing's, which carry the trace to decode
        self._tls = tls
        self._server_name = server_name
        self._channels: dict[str, grpc.aio.Channel] = {}
        # endpoint None: grpc only, no Pair call (tests' KV receivers)
        self._endpoint = endpoint
        self._layout = layout
        self._dtype = dtype
        self._pairings: dict[str, Pairing] = {}
        self._pairing: dict[str, asyncio.Future[Pairing]] = {}
        self._sweeper: asyncio.Future[None] | None = None

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = make_channel(
                address,
                tls=self._tls,
                server_name=self._server_name(address),
                max_message_bytes=self._max_message_bytes,
                interceptors=self._interceptors,
            )
            self._channels[address] = channel
        return channel

    def transports(self) -> dict[str, str]:
        """Decode address -> transport of every pair set up (Info reports them)."""
        return {address: p.transport for address, p in self._pairings.items()}

    async def pair(self, address: str) -> Pairing:
        """The pair's transport, set up on first use (one Pair call even when many transfers
        start at once); grpc when decode cannot pair or Pair fails. Waits (a little) for the
        channel to be connected first. FailedPrecondition when the pair would be grpc and our
        chunk messages can be larger than decode receives."""
        await self._ready(address)
        done = self._pairings.get(address)
        if done is not None:
            return done
        if self._endpoint is None:
            return GRPC_PAIRING
        pending = self._pairing.get(address)
        if pending is None:
            pending = asyncio.ensure_future(self._pair(address))
            self._pairing[address] = pending
            pending.add_done_callback(lambda _: self._pairing.pop(address, None))
        return await asyncio.shield(pending)

    async def _ready(self, address: str) -> None:
        """Up to _READY_WAIT_S for the channel to `address` to be connected (at once when it
        is); the transfer then reports decode's state either way."""
        channel = self.get(address)
        if channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY:
            return
        try:
            async with asyncio.timeout(_READY_WAIT_S):
                await channel.channel_ready()
        except TimeoutError:
            _LOG.debug("decode at %s: not connected after %.1f s", address, _READY_WAIT_S)

    async def _pair(self, address: str) -> Pairing:
        assert self._endpoint is not None and self._layout is not None
        endpoint = self._endpoint
        request = kv_pb2.PairRequest(
            host_id=endpoint.host_id,
            device=endpoint.device,
            transports=endpoint.transports,
            layout=self._layout,
            checksums=checksums.available(),
        )
        call = self.get(address).unary_unary(
            _PAIR, response_deserializer=kv_pb2.PairResponse.FromString
        )
        try:
            response = await call(request.SerializeToString(), timeout=_PAIR_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            # The transfer itself will report decode's state; no pair is remembered, the next
            # transfer asks again.
            return GRPC_PAIRING
        checksum = response.checksum
        if checksum not in checksums.available():
            checksum = checksums.CRC32  # a decode that misread us: it reads crc32 too
        pairing = Pairing(GrpcTransport(), checksum)
        if response.transport in endpoint.transports:
            try:
                transport = connect(response, self._layout, self._dtype, endpoint.device)
                pairing = Pairing(transport, checksum)
            except (OSError, ValueError, RuntimeError) as e:
                _LOG.warning(
                    "KV pair with decode at %s: cannot map its pool (%s); grpc", address, e
                )
        elif GRPC not in endpoint.transports:
            # --kv-transport forced shm or cuda-ipc (usable() then offers only that one), and
            # decode answered grpc: that pair runs, but not as the operator asked.
            why = (
                "decode's host id differs from ours: shared memory needs one host (--host-id)"
                if not endpoint.host_id or response.host_id != endpoint.host_id
                else "decode does not offer it (its --kv-transport or device), or its KV layout "
                "differs"
            )
            _LOG.warning(
                "KV pair with decode at %s: --kv-transport %s cannot be used (%s); grpc",
                address,
                endpoint.transports[0],
                why,
            )
        limit = response.max_message_bytes
        if not pairing.kv.is_in_place and self._largest_message_bytes > limit:
            # Not remembered: the next transfer asks again (decode may be restarted with more).
            raise FailedPrecondition(
                f"decode at {address} receives messages of at most {limit} bytes (its gRPC "
                "receive limit, --max-message-bytes), but this prefill's KV chunks over grpc "
                f"take up to {self._largest_message_bytes}: raise decode's --max-message-bytes "
                "or lower prefill's --max-batch-tokens"
            )
        self._pairings[address] = pairing
        if pairing.kv.is_in_place and self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._sweep_forever())
        _LOG.info(
            "KV pair with decode at %s: transport %s, checksum %s",
            address,
            pairing.transport,
            pairing.checksum,
        )
        return pairing

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(_SWEEP_INTERVAL_S)
            self.sweep()

    def sweep(self) -> None:
        """Forget the in-place pairs (shm, cuda-ipc) whose decode process is gone (killed
        between transfers, so no transfer failed to tell us; a decode restarted on the same
        address has a new pool) and unlink the segments of dead owners (also of a decode
        still exiting when its pair was forgotten). Runs every second once a pair is in
        place; it only checks pids and lists /dev/shm."""
        for address, pairing in list(self._pairings.items()):
            if not pairing.kv.is_peer_alive():
                self.forget(address)
        for path in sweep_stale():
            _LOG.info("unlinked %s: its decode instance is gone", path)

    def forget(self, address: str) -> None:
        """Decode went away: drop the pair (and its mapping); unlink segments of dead owners."""
        pairing = self._pairings.pop(address, None)
        if pairing is not None and pairing.kv.is_in_place:
            pairing.kv.close()
            for path in sweep_stale():
                _LOG.info("unlinked %s: its decode instance is gone", path)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
        for address in list(self._pairings):
            self.forget(address)
