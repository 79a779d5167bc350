"""The KV hand-off's one interface, `KvTransport`, and the choice of one per prefill -> decode
pair, made once (KvTransferService.Pair). The model is vLLM's KVConnectorBase_V1: one seam, a
class per way of moving the bytes (GrpcTransport and ShmTransport below, CudaIpcTransport in
cuda_ipc_transport.py).

Every transfer is the same conversation whatever the transport (services/prefill/sender.py,
services/decode/transfer.py): header, chunks in seq order, commit, all on TransferKv. What a
transport decides is how a chunk's bytes get from prefill's tensors into decode's blocks:

    prefill: encode_all(parts), an encoder thread     decode: land_all(chunks), a landing thread
    grpc      the bytes go in the chunk message   ─▶  checked, scattered into the blocks
    shm       written into decode's pool in /dev/shm  what the blocks hold, checked
    cuda-ipc  copied device to device into its pool   what the blocks hold, checked on the GPU

Decode holds one object per transport its pool receives over (`receivers`) and answers Pair
with the fastest both sides offer (`answer`); prefill makes its object from that answer, with
decode's pool mapped once (`connect`). Nothing else asks which transport a pair has.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from mili.engine.kv.kv_layout import KVLayout
from mili.engine.model.kv_cache import KVCache, pool_bytes, pool_views
from mili.errors import DataLoss
from mili.kv_handoff import checksums
from mili.kv_handoff.block_rows import as_rows, block_rows, copy_rows, fits
from mili.kv_handoff.codec import (
    Chunk,
    announced,
    chunk_name,
    decode_chunk,
    encode_chunk_in_place,
    encode_chunk_request,
    in_place_pools,
    rows_digest,
)
from mili.kv_handoff.cuda_ipc_transport import CudaIpcTransport
from mili.kv_handoff.kv_part import KvPart
from mili.kv_handoff.kv_transport import CUDA_IPC, GRPC, SHM, Endpoint, choose
from mili.kv_handoff.shm_segment import Segment, is_alive
from mili.pb.kv.v1 import kv_pb2


class KvTransport(Protocol):
    """How one pair's KV bytes travel. Both ends hold one; neither method runs on the event loop.

    - `encode_all` (prefill) is called once per job of chunks (one, or a backlog), on an
      encoder thread; with `is_in_place` only after decode accepted the transfer's header
      (until then the blocks may belong to another request). k, v on the CPU unless
      `takes_device_tensors`. Returns per chunk (a part's layers, in order, numbered from
      `seq`) the serialized
      TransferKvRequest{chunk} that announces the blocks, carrying `checksum` (a checksums
      name) of the bytes as decode will read them, and the payload bytes moved in all.
    - `land_all` (decode) is called once per landing job (one chunk, or a share of a message's
      chunks), on a landing thread, after the chunks' places in the transfer were checked
      (request, seq, blocks of its reservation) and with the request's blocks held. It raises
      DataLoss when bytes are short, corrupt or not in place; once it returns, the blocks hold
      exactly what prefill encoded. A job is the unit so that a transport can batch its device
      work: cuda-ipc reads its checksums back once per job (a whole message's), not per chunk.
    - In place (`is_in_place`), chunks carry no data and several may come in one message
      (TransferKvRequest.chunks); otherwise each chunk message carries its bytes.
    """

    name: str  # a kv_transport name: what Pair answered and the header carries
    is_in_place: bool  # prefill writes decode's blocks itself
    # encode takes k, v on prefill's GPU as they are, and land checks on the device (decode
    # gives a message's chunks to one landing job: a share per thread would each pay launches)
    takes_device_tensors: bool

    def encode_all(
        self, request_id: str, seq: int, parts: Sequence[KvPart], checksum: str
    ) -> tuple[list[bytes], int]:
        """Prefill: move each part towards decode's blocks; (chunk messages, payload bytes)."""
        ...

    def land_all(self, chunks: Sequence[Chunk], checksum: str) -> None:
        """Decode: make sure (and, over grpc, make) the chunks' blocks hold their bytes."""
        ...

    def reply(self, response: kv_pb2.PairResponse) -> None:
        """Decode: fill in Pair's reply with what prefill needs to reach the pool."""
        ...

    def is_peer_alive(self) -> bool:
        """Prefill: False once the process that owns the mapped pool is known to be gone."""
        ...

    def close(self) -> None:
        """Prefill: drop this side's mapping of decode's pool. Transfers still writing through
        it keep their views: the memory stays mapped until the last of them lets go."""
        ...


# ---- the transports ----------------------------------------------------------------------------


class Scatter(Protocol):
    """Where decode lands a chunk's blocks (its KVWriter: host or device copies, off the
    step)."""

    def scatter(self, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write whole blocks of one layer (k, v: [n, block_size, num_kv_heads, head_dim])."""


class _ChunkByChunk:
    """`encode_all` and `land_all` of the transports that move one chunk at a time (grpc, shm):
    each part's layers in order, a chunk message each."""

    def encode(
        self,
        request_id: str,
        seq: int,
        layer: int,
        block_ids: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        checksum: str,
    ) -> tuple[bytes, int]:
        raise NotImplementedError

    def land(self, chunk: Chunk, checksum: str) -> None:
        raise NotImplementedError

    def encode_all(
        self, request_id: str, seq: int, parts: Sequence[KvPart], checksum: str
    ) -> tuple[list[bytes], int]:
        messages: list[bytes] = []
        num_bytes = 0
        for part in parts:
            for i, (k, v) in enumerate(part.kv):
                message, n = self.encode(
                    request_id, seq + len(messages), part.layer + i, part.block_ids, k, v, checksum
                )
                messages.append(message)
                num_bytes += n
        return messages, num_bytes

    def land_all(self, chunks: Sequence[Chunk], checksum: str) -> None:
        for chunk in chunks:
            self.land(chunk, checksum)


class GrpcTransport(_ChunkByChunk):
    """Transport "grpc": the KV bytes ride in the chunk messages (any two hosts, any devices).
    Prefill copies k, v into the message once (codec.encode_chunk_request); decode checks the
    bytes against `layout` and the checksum, then `cache` scatters them into the blocks. A
    prefill's object has neither: it lands nothing."""

    name = GRPC
    is_in_place = False
    takes_device_tensors = False

    def __init__(self, layout: kv_pb2.KvLayout | None = None, cache: Scatter | None = None):
        self._layout = layout
        self._cache = cache

    def encode(
        self,
        request_id: str,
        seq: int,
        layer: int,
        block_ids: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        checksum: str,
    ) -> tuple[bytes, int]:
        return encode_chunk_request(request_id, seq, layer, block_ids, k, v, checksum)

    def land(self, chunk: Chunk, checksum: str) -> None:
        if self._layout is None or self._cache is None:
            raise RuntimeError("a sender's grpc transport lands nothing")
        k, v = decode_chunk(chunk, self._layout, checksum)  # DataLoss: short, corrupt
        self._cache.scatter(chunk.layer, list(chunk.block_ids), k, v)

    def reply(self, response: kv_pb2.PairResponse) -> None:
        pass  # nothing to reach: the bytes come with the chunks

    def is_peer_alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


class ShmTransport(_ChunkByChunk):
    """Transport "shm": prefill writes prompt blocks straight into decode's pool in POSIX
    shared memory (one host, CPU pools); the chunk message carries block ids and the checksum
    only. The pool is in `segment`, as both ends map it: decode owns it, prefill attaches once
    per pair (`connect`)."""

    name = SHM
    is_in_place = True
    takes_device_tensors = False

    def __init__(self, segment: Segment, layout: KVLayout, num_blocks: int, dtype: torch.dtype):
        self.segment = segment
        self.num_blocks = num_blocks
        self.k, self.v = pool_views(segment.tensor, layout, num_blocks, dtype)
        # The same pools as byte rows [num_blocks, bytes per block], made once: the encoder and
        # landing threads then make no torch call per block or pool (each a GIL hand-off).
        self._rows = [(block_rows(k), block_rows(v)) for k, v in zip(self.k, self.v, strict=True)]

    @classmethod
    def connect(
        cls, response: kv_pb2.PairResponse, layout: KVLayout, dtype: torch.dtype
    ) -> ShmTransport:
        """Prefill: map the segment decode's Pair reply names (OSError, ValueError)."""
        size = pool_bytes(layout, response.num_blocks, dtype)
        segment = Segment.attach(response.shm_path, size)
        return cls(segment, layout, response.num_blocks, dtype)

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
        """Write k, v (CPU) into decode's blocks; the copies release the GIL where the ids come
        in runs (block_rows.copy_rows)."""
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
        # The checksum of what we mean to write (k's blocks, then v's: what `land` reads back),
        # each taken just before its copy, so that the copy reads the source from cache: one
        # pass over memory fewer than digesting the destination.
        running = checksums.Running(checksum)
        for src, rows in ((k, k_rows), (v, v_rows)) if n else ():
            src_rows = as_rows(src, n)
            running.update(src_rows.data)
            copy_rows(rows, ids, src_rows)
        message = encode_chunk_in_place(request_id, seq, layer, ids, running.value(), checksum)
        return message, 2 * n * k_rows.shape[1]

    def land(self, chunk: Chunk, checksum: str) -> None:
        in_place_pools(chunk, self.k, self.v)  # DataLoss: not an in-place chunk
        k_rows, v_rows = self._rows[chunk.layer]
        value = rows_digest(checksum, k_rows, v_rows, chunk.block_ids)
        if value != announced(chunk, checksum):
            raise DataLoss(f"{chunk_name(chunk)}: checksum mismatch (blocks corrupted in place)")

    def reply(self, response: kv_pb2.PairResponse) -> None:
        response.shm_path = str(self.segment.path)

    def is_peer_alive(self) -> bool:
        pid = self.segment.owner_pid
        return pid is None or is_alive(pid)

    def close(self) -> None:
        self.segment.close()


# ---- decode ------------------------------------------------------------------------------------


def receivers(
    layout: kv_pb2.KvLayout,
    cache: KVCache,
    scatter: Scatter,
    *,
    segment: Segment | None = None,
    ipc_export: bytes = b"",
) -> dict[str, KvTransport]:
    """Decode: the transports its pool receives over, by name. grpc always (`layout` checks
    its chunks, `scatter` lands them); shm when the pool is in `segment`; cuda-ipc when it was
    exported (`ipc_export`)."""
    transports: dict[str, KvTransport] = {GRPC: GrpcTransport(layout, scatter)}
    if segment is not None:
        transports[SHM] = ShmTransport(segment, cache.layout, cache.num_blocks, cache.dtype)
    if ipc_export:
        transports[CUDA_IPC] = CudaIpcTransport(cache.blocks, ipc_export)
    return transports


def answer(
    request: kv_pb2.PairRequest,
    receiver: Endpoint,
    layout: kv_pb2.KvLayout,
    transports: dict[str, KvTransport],
    num_blocks: int,
) -> kv_pb2.PairResponse:
    """Decode's reply to Pair: the fastest transport both sides offer, of those it has
    (`receivers`); grpc when the layouts differ (the transfer's header then reports it)."""
    sender = Endpoint(request.host_id, request.device, tuple(request.transports))
    offered = tuple(t for t in receiver.transports if t in transports)
    name = choose(sender, receiver._replace(transports=offered))
    if transports[name].is_in_place and request.layout != layout:
        name = GRPC
    response = kv_pb2.PairResponse(
        transport=name,
        host_id=receiver.host_id,
        num_blocks=num_blocks,
        checksum=checksums.choose(request.checksums),
    )
    transports[name].reply(response)
    return response


# ---- prefill -----------------------------------------------------------------------------------


def connect(
    response: kv_pb2.PairResponse, layout: kv_pb2.KvLayout, dtype: torch.dtype, device: str
) -> KvTransport:
    """Prefill (its KV on `device`): the transport decode's reply chose, decode's pool mapped
    here when it is an in-place one (OSError, ValueError or RuntimeError when that fails)."""
    if response.transport not in (SHM, CUDA_IPC):
        return GrpcTransport()
    kv_layout = KVLayout(
        layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim, layout.dtype
    )
    if response.transport == SHM:
        return ShmTransport.connect(response, kv_layout, dtype)
    return CudaIpcTransport.connect(response, kv_layout, dtype, torch.device(device))
