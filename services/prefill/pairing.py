"""Prefill's side of KV pairs: one channel per decode address, and the transport its KV bytes
take there, chosen once with decode's KvTransferService.Pair (see mili.engine.kv_transport).

    first transfer to an address ─▶ Pair(host id, device, transports, layout)
                                 ◀─ transport (+ the shm segment of decode's KV pool)
    "shm": the segment is mapped once here and kept for every later transfer

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

from mili.engine.kv_cache import pool_bytes, pool_views
from mili.engine.kv_layout import KVLayout
from mili.kv.v1 import kv_pb2
from mili.kv_handoff import checksums, kv_transport
from mili.kv_handoff.block_rows import as_rows, block_rows, block_runs, copy_rows, fits
from mili.kv_handoff.codec import encode_chunk_in_place
from mili.kv_handoff.cuda_ipc import blocks_checksum, import_pool
from mili.kv_handoff.kv_transport import Endpoint
from mili.kv_handoff.shm_segment import Segment, is_alive, sweep_stale
from mili.rpc.client import channel as make_channel
from mili.rpc.tls import Tls

_LOG = logging.getLogger("mili.prefill")
_SERVICE = kv_pb2.DESCRIPTOR.services_by_name["KvTransferService"].full_name
_PAIR = f"/{_SERVICE}/Pair"
_PAIR_TIMEOUT_S = 5.0
_SWEEP_INTERVAL_S = 1.0  # how soon a decode killed between transfers loses its segment


class ShmPool:
    """Decode's KV pool mapped here: prefill writes prompt blocks into it directly."""

    def __init__(self, segment: Segment, layout: KVLayout, num_blocks: int, dtype: torch.dtype):
        self.segment = segment
        self.num_blocks = num_blocks
        self.k, self.v = pool_views(segment.tensor, layout, num_blocks, dtype)
        # The same pools as byte rows [num_blocks, bytes per block], made once: the encoder
        # threads then make no torch call per block or pool (each one is a GIL hand-off).
        self._rows = [(block_rows(k), block_rows(v)) for k, v in zip(self.k, self.v, strict=True)]

    def encode(
        self,
        request_id: str,
        seq: int,
        layer: int,
        block_ids: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        checksum: str = checksums.CRC32,
    ) -> tuple[bytes, int]:
        """Write k, v ([n, block_size, kv_heads, D], CPU) into decode's blocks `block_ids` of
        `layer`; return the chunk message that announces them (no data, the `checksum` of what
        they now hold) and the bytes written. Runs on an encoder thread (the copies release the
        GIL where the ids come in runs, see block_rows.copy_rows)."""
        ids = list(block_ids)
        n = len(ids)
        k_pool, v_pool = self.k[layer], self.v[layer]
        k, v = k.contiguous(), v.contiguous()
        if not (fits(k_pool, ids, k) and fits(v_pool, ids, v)):
            raise ValueError(
                f"blocks {ids} of {tuple(k.shape)} {k.dtype} do not fit decode's pool of "
                f"{self.num_blocks} blocks {tuple(k_pool.shape[1:])} {k_pool.dtype}"
            )
        k_rows, v_rows = self._rows[layer]
        # The checksum of what we mean to write (k's blocks, then v's: what decode's
        # blocks_digest reads back), each taken just before its copy, so that the copy reads
        # the source from cache: one pass over memory fewer than digesting the destination.
        running = checksums.Running(checksum)
        for src, rows in ((k, k_rows), (v, v_rows)) if n else ():
            src_rows = as_rows(src, n)
            running.update(src_rows.data)
            copy_rows(rows, ids, src_rows)
        value = running.value()
        num_bytes = 2 * n * k_rows.shape[1]
        message = encode_chunk_in_place(request_id, seq, layer, block_ids, value, checksum)
        return message, num_bytes

    def close(self) -> None:
        """Drop the mapping. Transfers still writing through this pool (the pair was forgotten
        under them) keep k, v: the memory stays mapped until the last of them lets go."""
        self.segment.close()


class CudaIpcPool:
    """Decode's KV pool on a GPU, mapped here with CUDA IPC: prompt blocks are copied device to
    device on a side stream (never the model's), then checksummed on the device."""

    def __init__(self, flat: torch.Tensor, layout: KVLayout, num_blocks: int, dtype: torch.dtype):
        self.num_blocks = num_blocks
        self.k, self.v = pool_views(flat, layout, num_blocks, dtype)
        self._stream = torch.cuda.Stream(flat.device)

    def encode(
        self,
        request_id: str,
        seq: int,
        layer: int,
        block_ids: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        checksum: str = checksums.CRC32,
    ) -> tuple[bytes, int]:
        """As ShmPool.encode, with k, v on prefill's GPU (the worker's gather, complete: the
        sender called its `ready` first) and the device checksum in crc32 (`checksum` does
        not apply). Blocks until the copy is over, on this encoder thread only."""
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"block ids {list(block_ids)} outside decode's pool")
        k_pool, v_pool = self.k[layer], self.v[layer]
        expected = (len(block_ids), *k_pool.shape[1:])
        for t in (k, v):
            if tuple(t.shape) != expected or t.dtype != k_pool.dtype:
                raise ValueError(
                    f"{tuple(t.shape)} {t.dtype} does not fit {len(block_ids)} blocks of "
                    f"decode's pool {tuple(k_pool.shape[1:])} {k_pool.dtype}"
                )
        first = 0
        with torch.inference_mode(), torch.cuda.stream(self._stream):
            for start, stop in block_runs(block_ids):
                n = stop - start
                k_pool[start:stop].copy_(k[first : first + n], non_blocking=True)
                v_pool[start:stop].copy_(v[first : first + n], non_blocking=True)
                first += n
            value = blocks_checksum(k_pool, v_pool, block_ids)  # waits for the copies
        num_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
        return encode_chunk_in_place(request_id, seq, layer, block_ids, value), num_bytes

    def close(self) -> None:
        pass  # torch closes the IPC mapping with the last view (transfers may still hold some)


class Pairing(NamedTuple):
    transport: str
    checksum: str = checksums.CRC32  # what every chunk carries (kv_checksum)
    pool: ShmPool | CudaIpcPool | None = None


GRPC_PAIRING = Pairing(kv_transport.GRPC)


class Peers:
    """One channel and one pairing per decode address, shared by every transfer to it (one
    HTTP/2 connection, reconnected by grpc when it drops). With `tls`, channels are TLS and
    present our certificate; `server_name(address)` gives the name to verify decode's
    certificate against (the DNS name an instance was found by; None: the address's host)."""

    def __init__(
        self,
        max_message_bytes: int,
        *,
        endpoint: Endpoint | None = None,
        layout: kv_pb2.KvLayout | None = None,
        dtype: torch.dtype = torch.float32,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        tls: Tls | None = None,
        server_name: Callable[[str], str | None] = lambda address: None,
    ) -> None:
        self._max_message_bytes = max_message_bytes
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
        start at once); grpc when decode cannot pair or Pair fails."""
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

    async def _pair(self, address: str) -> Pairing:
        assert self._endpoint is not None
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
        pairing = Pairing(kv_transport.GRPC, checksum)
        if response.transport in endpoint.transports and response.transport != kv_transport.GRPC:
            try:
                pool = self._map(response)
                pairing = Pairing(response.transport, checksum, pool)
            except (OSError, ValueError, RuntimeError) as e:
                _LOG.warning(
                    "KV pair with decode at %s: cannot map its pool (%s); grpc", address, e
                )
        self._pairings[address] = pairing
        if pairing.pool is not None and self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._sweep_forever())
        _LOG.info(
            "KV pair with decode at %s: transport %s, checksum %s",
            address,
            pairing.transport,
            pairing.checksum,
        )
        return pairing

    def _map(self, response: kv_pb2.PairResponse) -> ShmPool | CudaIpcPool:
        assert self._layout is not None
        layout = KVLayout(
            self._layout.num_layers,
            self._layout.block_size,
            self._layout.num_kv_heads,
            self._layout.head_dim,
            self._layout.dtype,
        )
        size = pool_bytes(layout, response.num_blocks, self._dtype)
        if response.transport == kv_transport.CUDA_IPC:
            flat = import_pool(response.cuda_ipc_export)
            if flat.numel() != size:
                raise ValueError(f"decode's pool holds {flat.numel()} bytes, expected {size}")
            return CudaIpcPool(flat, layout, response.num_blocks, self._dtype)
        segment = Segment.attach(response.shm_path, size)
        return ShmPool(segment, layout, response.num_blocks, self._dtype)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(_SWEEP_INTERVAL_S)
            self.sweep()

    def sweep(self) -> None:
        """Forget the shm pairs whose decode process is gone (killed between transfers, so no
        transfer failed to tell us) and unlink the segments of dead owners (also of a decode
        still exiting when its pair was forgotten). Runs every second once a pair took shm;
        it only lists /dev/shm."""
        for address, pairing in list(self._pairings.items()):
            if not isinstance(pairing.pool, ShmPool):
                continue
            pid = pairing.pool.segment.owner_pid
            if pid is not None and not is_alive(pid):
                self.forget(address)
        for path in sweep_stale():
            _LOG.info("unlinked %s: its decode instance is gone", path)

    def forget(self, address: str) -> None:
        """Decode went away: drop the pair (and its mapping); unlink segments of dead owners."""
        pairing = self._pairings.pop(address, None)
        if pairing is not None and pairing.pool is not None:
            pairing.pool.close()
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
