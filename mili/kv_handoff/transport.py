"""The KV hand-off's one interface, `KvTransport`, and the choice of one per prefill -> decode
pair, made once (KvTransferService.Pair). The model is vLLM's KVConnectorBase_V1: one seam, a
class per way of moving the bytes (grpc_transport, shm_transport, cuda_ipc_transport).

Every transfer is the same conversation whatever the transport (services/prefill/sender.py,
services/decode/transfer.py): header, chunks in seq order, commit, all on TransferKv. What a
transport decides is how a chunk's bytes get from prefill's tensors into decode's blocks:

    prefill: encode(k, v), an encoder thread          decode: land(chunk), a landing thread
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
from mili.engine.model.kv_cache import KVCache
from mili.kv_handoff import checksums
from mili.kv_handoff.codec import Chunk
from mili.kv_handoff.cuda_ipc_transport import CudaIpcTransport
from mili.kv_handoff.grpc_transport import GrpcTransport, Scatter
from mili.kv_handoff.kv_transport import CUDA_IPC, GRPC, SHM, Endpoint, choose
from mili.kv_handoff.shm_segment import Segment
from mili.kv_handoff.shm_transport import ShmTransport
from mili.pb.kv.v1 import kv_pb2


class KvTransport(Protocol):
    """How one pair's KV bytes travel. Both ends hold one; neither method runs on the event loop.

    - `encode` (prefill) is called once per chunk, on an encoder thread; with `is_in_place`
      only after decode accepted the transfer's header (until then the blocks may belong to
      another request). k, v: [len(block_ids), block_size, num_kv_heads, head_dim], on the CPU
      unless `takes_device_tensors`. Returns the serialized TransferKvRequest{chunk} that
      announces the blocks, carrying `checksum` (a checksums name) of the bytes as decode will
      read them, and the payload bytes moved.
    - `land` (decode) is called once per chunk, on a landing thread, after the chunk's place in
      the transfer was checked (request, seq, blocks of its reservation) and with the request's
      blocks held. It raises DataLoss when the bytes are short, corrupt or not in place; once it
      returns, the blocks hold exactly what prefill encoded.
    - In place (`is_in_place`), chunks carry no data and several may come in one message
      (TransferKvRequest.chunks); otherwise each chunk message carries its bytes.
    """

    name: str  # a kv_transport name: what Pair answered and the header carries
    is_in_place: bool  # prefill writes decode's blocks itself
    takes_device_tensors: bool  # encode takes k, v on prefill's GPU as they are

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
        """Prefill: move k, v towards decode's blocks `block_ids` of `layer`; (chunk message,
        payload bytes)."""
        ...

    def land(self, chunk: Chunk, checksum: str) -> None:
        """Decode: make sure (and, over grpc, make) the chunk's blocks hold its bytes."""
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
        transports[CUDA_IPC] = CudaIpcTransport(cache.k, cache.v, ipc_export)
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
    response: kv_pb2.PairResponse, layout: kv_pb2.KvLayout, dtype: torch.dtype
) -> KvTransport:
    """Prefill: the transport decode's reply chose, decode's pool mapped here when it is an
    in-place one (OSError, ValueError or RuntimeError when that fails)."""
    if response.transport not in (SHM, CUDA_IPC):
        return GrpcTransport()
    kv_layout = KVLayout(
        layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim, layout.dtype
    )
    mapped = ShmTransport if response.transport == SHM else CudaIpcTransport
    return mapped.connect(response, kv_layout, dtype)
