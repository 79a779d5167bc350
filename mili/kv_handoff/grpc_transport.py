"""Transport "grpc": the KV bytes ride in the chunk messages (any two hosts, any devices)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from mili.kv_handoff.codec import Chunk, decode_chunk, encode_chunk_request
from mili.kv_handoff.kv_transport import GRPC
from mili.pb.kv.v1 import kv_pb2


class Scatter(Protocol):
    """Where decode lands a chunk's blocks (its batcher: host or device copies, off the step)."""

    def scatter(self, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write whole blocks of one layer (k, v: [n, block_size, num_kv_heads, head_dim])."""


class GrpcTransport:
    """A `transport.KvTransport`. Prefill copies k, v into the message once
    (codec.encode_chunk_request); decode checks the bytes against `layout` and the checksum,
    then `cache` scatters them into the blocks. A prefill's object has neither: it lands
    nothing."""

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
