"""Transport "cuda-ipc" (mili.kv_handoff.transport's `KvTransport`): prefill copies prompt
blocks device to device into decode's pool, mapped with CUDA IPC (cuda_ipc.py: the export, the
mapping and the device checksum; this module: the transport that uses them)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from mili.engine.kv.kv_layout import KVLayout
from mili.engine.model.kv_cache import pool_blocks, pool_bytes
from mili.engine.step.pinned import thread_stream
from mili.errors import DataLoss
from mili.kv_handoff.codec import Chunk, chunk_name, encode_chunk_in_place, in_place_pools
from mili.kv_handoff.cuda_ipc import chunk_checksums, import_pool, kv_checksums, owner
from mili.kv_handoff.kv_part import KvPart
from mili.kv_handoff.kv_transport import CUDA_IPC
from mili.kv_handoff.shm_segment import is_alive
from mili.pb.kv.v1 import kv_pb2


class CudaIpcTransport:
    """Transport "cuda-ipc": prefill copies prompt blocks device to device into decode's pool,
    exported once with CUDA IPC (one host, GPU pools; see cuda_ipc.py). `blocks`: the whole
    pool (kv_cache.pool_blocks' view, [num_layers, 2, num_blocks, block_size, num_kv_heads,
    head_dim]), decode's own (with `export`, what Pair hands out) or mapped by prefill
    (`connect`). A part of several layers costs one copy and one checksum pass for all of them
    (prefill hands cuda-ipc a prompt chunk's every layer at once). Chunks carry the device
    checksum (cuda_ipc.kv_checksums) of what prefill copied in crc32, whatever the pair's
    checksum, and decode checks its blocks against it (cuda_ipc.chunk_checksums). The GPU tests
    (tests/prefill/test_cuda_ipc.py, -m gpu) run it between processes; on CPU tensors (no
    stream, no export) tests/kv_handoff/test_cuda_ipc_transport.py runs its copies and checks."""

    name = CUDA_IPC
    is_in_place = True
    takes_device_tensors = True

    def __init__(self, blocks: torch.Tensor, export: bytes = b"", owner_pid: int | None = None):
        """`export`: decode's, handed out by Pair; `owner_pid`: prefill's, the pid of the
        decode whose pool `blocks` maps (None: not known here)."""
        self.blocks = blocks
        self.k = [b[0] for b in blocks]
        self.v = [b[1] for b in blocks]
        self.num_blocks = blocks.shape[2]
        self._export = export
        self._owner_pid = owner_pid
        # prefill's copies: never on the model's stream
        self._stream = torch.cuda.Stream(blocks.device) if blocks.device.type == "cuda" else None

    @classmethod
    def connect(
        cls,
        response: kv_pb2.PairResponse,
        layout: KVLayout,
        dtype: torch.dtype,
        device: torch.device,
    ) -> CudaIpcTransport:
        """Prefill, its KV on `device`: map the pool decode's Pair reply exports (ValueError,
        RuntimeError)."""
        flat = import_pool(response.cuda_ipc_export)
        if flat.device != device:  # kv_transport.choose pairs one device only
            raise ValueError(f"decode's pool is on {flat.device}, this prefill's KV on {device}")
        size = pool_bytes(layout, response.num_blocks, dtype)
        if flat.numel() != size:
            raise ValueError(f"decode's pool holds {flat.numel()} bytes, expected {size}")
        # Mapping waited for decode's export event on this thread's current stream; the side
        # stream the copies run on never did.
        torch.cuda.current_stream(device).synchronize()
        blocks = pool_blocks(flat, layout, response.num_blocks, dtype)
        return cls(blocks, owner_pid=owner(response.cuda_ipc_export))

    def encode_all(
        self, request_id: str, seq: int, parts: Sequence[KvPart], checksum: str = ""
    ) -> tuple[list[bytes], int]:
        """kv on prefill's GPU (the worker's gathers, complete: the sender called their
        `ready` first), copied into decode's blocks on a side stream, one index_copy_ per part
        (all its layers; a transfer's block ids rarely run consecutively); the chunks carry
        the checksums of what was copied (the gathers: no gather of the blocks again), all
        parts read back at once, which decode checks against what its blocks hold; blocks
        until the copies are over, on this encoder thread only. `checksum` does not apply."""
        num_bytes = 0
        with torch.inference_mode(), _on(self._stream):
            try:
                for part in parts:
                    ids = self._check(part)
                    index = torch.tensor(ids, dtype=torch.int64)
                    index = index.to(part.kv.device, non_blocking=True)
                    layers = slice(part.layer, part.layer + part.num_layers)
                    self.blocks[layers].index_copy_(2, index, part.kv)
                    num_bytes += part.kv.numel() * part.kv.element_size()
                # queued behind the copies on this stream: its read back waits for them
                values = kv_checksums([part.kv for part in parts])
            except BaseException:
                # Copies already queued read the parts' gathers (the model stream's memory):
                # they must be over before the caller lets the gathers go.
                if self._stream is not None:
                    self._stream.synchronize()
                raise
        messages: list[bytes] = []
        for part in parts:
            for i in range(part.num_layers):
                value = values[len(messages)]
                layer = part.layer + i
                message = encode_chunk_in_place(
                    request_id, seq + len(messages), layer, part.block_ids, value
                )
                messages.append(message)
        return messages, num_bytes

    def _check(self, part: KvPart) -> list[int]:
        """The part's block ids (ValueError: outside decode's pool or its layers, or kv does
        not fit it)."""
        ids = list(part.block_ids)
        if any(not 0 <= b < self.num_blocks for b in ids):
            raise ValueError(f"block ids {ids} outside decode's pool")
        pool = self.blocks
        expected = (part.num_layers, 2, len(ids), *pool.shape[3:])
        if (
            not 0 <= part.layer <= part.layer + part.num_layers <= pool.shape[0]
            or tuple(part.kv.shape) != expected
            or part.kv.dtype != pool.dtype
        ):
            raise ValueError(
                f"layers {part.layer}+{part.num_layers} {tuple(part.kv.shape)} {part.kv.dtype} "
                f"do not fit decode's pool {tuple(pool.shape)} {pool.dtype}"
            )
        return ids

    def land_all(self, chunks: Sequence[Chunk], checksum: str) -> None:
        """The device checksums of what the chunks' blocks hold now, on this landing thread's
        own stream (the decode step never waits for them), read back once. Chunks of the
        same blocks in consecutive layers (a prompt chunk's, as prefill sends them) are
        checked as one run of layers."""
        if not chunks:
            return
        for chunk in chunks:
            in_place_pools(chunk, self.k, self.v)  # DataLoss: not in place, layer out of range
        device = self.blocks.device
        runs: list[tuple[torch.Tensor, torch.Tensor]] = []
        with _on(None if device.type != "cuda" else thread_stream(device)):
            start = 0
            for end in range(1, len(chunks) + 1):
                if end < len(chunks) and _continues(chunks[end - 1], chunks[end]):
                    continue
                first = chunks[start]
                ids = torch.tensor(list(first.block_ids), dtype=torch.int64)
                layers = slice(first.layer, first.layer + end - start)
                runs.append((self.blocks[layers], ids.to(device, non_blocking=True)))
                start = end
            values = chunk_checksums(runs)
        for chunk, value in zip(chunks, values, strict=True):
            if value != chunk.crc32:
                raise DataLoss(
                    f"{chunk_name(chunk)}: checksum mismatch (blocks corrupted in place)"
                )

    def reply(self, response: kv_pb2.PairResponse) -> None:
        response.cuda_ipc_export = self._export

    def is_peer_alive(self) -> bool:
        # A decode that died between transfers (and is perhaps restarted on the same address,
        # with a new pool) must be forgotten before a transfer writes through the mapping of
        # its freed pool: the sweeper asks every second (a restart loads a model first).
        # Unknown owner (another pid namespace): a transfer's UNAVAILABLE forgets the pair.
        return self._owner_pid is None or is_alive(self._owner_pid)

    def close(self) -> None:
        pass  # torch closes the IPC mapping with the last view (transfers may still hold some)


def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
    """Work queued on `stream` (CUDA), or as it comes (None: CPU tensors)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def _continues(before: Chunk, after: Chunk) -> bool:
    """Whether `after` is the next layer of the same blocks as `before`."""
    return after.layer == before.layer + 1 and list(after.block_ids) == list(before.block_ids)
