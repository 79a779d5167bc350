"""Transport "cuda-ipc": prefill copies prompt blocks device to device into decode's KV pool,
exported once with CUDA IPC (one host, GPU pools; see cuda_ipc.py). Nothing here runs without
CUDA: tests/prefill/test_cuda_ipc.py (-m gpu) checks it on a GPU host."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mili.engine.kv.kv_layout import KVLayout
from mili.engine.model.kv_cache import pool_bytes, pool_views
from mili.engine.step.pinned import thread_stream
from mili.errors import DataLoss
from mili.kv_handoff.block_rows import block_runs
from mili.kv_handoff.codec import Chunk, chunk_name, encode_chunk_in_place, in_place_pools
from mili.kv_handoff.cuda_ipc import blocks_checksum, import_pool
from mili.kv_handoff.kv_transport import CUDA_IPC
from mili.pb.kv.v1 import kv_pb2


class CudaIpcTransport:
    """A `transport.KvTransport`: decode's pool on a GPU, per layer K and V [num_blocks,
    block_size, num_kv_heads, head_dim]; decode's own (with `export`, what Pair hands out) or
    mapped by prefill (`connect`). Chunks carry the device checksum (cuda_ipc.blocks_checksum)
    in crc32, whatever the pair's checksum."""

    name = CUDA_IPC
    is_in_place = True
    takes_device_tensors = True

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], export: bytes = b""):
        self.k, self.v = k, v
        self.num_blocks = k[0].shape[0]
        self._export = export
        self._stream = torch.cuda.Stream(k[0].device)  # prefill's copies: never the model's

    @classmethod
    def connect(
        cls, response: kv_pb2.PairResponse, layout: KVLayout, dtype: torch.dtype
    ) -> CudaIpcTransport:
        """Prefill: map the pool decode's Pair reply exports (ValueError, RuntimeError)."""
        flat = import_pool(response.cuda_ipc_export)
        size = pool_bytes(layout, response.num_blocks, dtype)
        if flat.numel() != size:
            raise ValueError(f"decode's pool holds {flat.numel()} bytes, expected {size}")
        return cls(*pool_views(flat, layout, response.num_blocks, dtype))

    def encode(
        self,
        request_id: str,
        seq: int,
        layer: int,
        block_ids: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        checksum: str = "",
    ) -> tuple[bytes, int]:
        """k, v on prefill's GPU (the worker's gather, complete: the sender called its `ready`
        first), copied on a side stream, then checksummed there; blocks until the copy is over,
        on this encoder thread only. `checksum` does not apply."""
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

    def land(self, chunk: Chunk, checksum: str) -> None:
        """The device checksum of what the blocks hold now, on this landing thread's own
        stream: the decode step never waits for it."""
        k_pool, v_pool = in_place_pools(chunk, self.k, self.v)  # DataLoss: not in place
        with torch.cuda.stream(thread_stream(k_pool.device)):
            value = blocks_checksum(k_pool, v_pool, list(chunk.block_ids))
        if value != chunk.crc32:
            raise DataLoss(f"{chunk_name(chunk)}: checksum mismatch (blocks corrupted in place)")

    def reply(self, response: kv_pb2.PairResponse) -> None:
        response.cuda_ipc_export = self._export

    def is_peer_alive(self) -> bool:
        return True  # a dead decode fails the next transfer (UNAVAILABLE), which forgets us

    def close(self) -> None:
        pass  # torch closes the IPC mapping with the last view (transfers may still hold some)
