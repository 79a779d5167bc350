"""Transport "shm": prefill writes prompt blocks straight into decode's KV pool in POSIX shared
memory (one host, CPU pools); the chunk message carries block ids and the checksum only."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mili.engine.kv.kv_layout import KVLayout
from mili.engine.model.kv_cache import pool_bytes, pool_views
from mili.errors import DataLoss
from mili.kv_handoff import checksums
from mili.kv_handoff.block_rows import as_rows, block_rows, copy_rows, fits
from mili.kv_handoff.codec import (
    Chunk,
    announced,
    chunk_name,
    encode_chunk_in_place,
    in_place_pools,
    rows_digest,
)
from mili.kv_handoff.kv_transport import SHM
from mili.kv_handoff.shm_segment import Segment, is_alive
from mili.pb.kv.v1 import kv_pb2


class ShmTransport:
    """A `transport.KvTransport`: decode's pool in `segment`, as both ends map it. Decode owns
    the segment, prefill attaches to it once per pair (`connect`)."""

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
