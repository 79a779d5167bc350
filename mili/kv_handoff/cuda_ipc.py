"""A KV pool on a GPU shared with another process through CUDA IPC (transport "cuda-ipc").

Decode allocates its pool as one flat device tensor (see `kv_cache.pool_views` for the
order: per layer, K then V), exports it once with torch's CUDA IPC export (the one
torch.multiprocessing sends: a cudaIpcMemHandle of the allocation, the pool's offset in it, and
the reference-counter and event handles torch uses to keep it alive); prefill maps it once per
pair and copies prompt blocks device to device on a side stream.

Integrity: `blocks_checksum` runs on the device on both sides over the blocks as they are (a
position-weighted sum of 32-bit words, wrapping: integer addition, so equal on any GPU in any
order), read back once per chunk on the caller's own stream, never the model's.

Written for the GPU host; tests/prefill/test_cuda_ipc.py (-m gpu) checks it there. Nothing here
runs without CUDA.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch


def export_pool(flat: torch.Tensor) -> bytes:
    """What a peer needs to map `flat` (a CUDA uint8 tensor owning its storage from offset 0)."""
    storage = flat.untyped_storage()
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
        storage._share_cuda_()
    )
    return json.dumps(
        {
            "device": int(device),
            "handle": bytes(handle).hex(),
            "size": int(size),
            "offset": int(offset),
            "ref_handle": bytes(ref_handle).hex(),
            "ref_offset": int(ref_offset),
            "event_handle": bytes(event_handle).hex() if event_handle else "",
            "event_sync": bool(event_sync),
            "numel": flat.numel(),
        }
    ).encode()


def import_pool(blob: bytes) -> torch.Tensor:
    """The exporter's flat pool, mapped here (ValueError on a malformed export)."""
    try:
        d = json.loads(blob)
        storage = torch.UntypedStorage._new_shared_cuda(
            d["device"],
            bytes.fromhex(d["handle"]),
            d["size"],
            d["offset"],
            bytes.fromhex(d["ref_handle"]),
            d["ref_offset"],
            bytes.fromhex(d["event_handle"]) if d["event_handle"] else None,
            d["event_sync"],
        )
        numel = int(d["numel"])
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed CUDA IPC export: {e}") from None
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{d['device']}")
    return flat.set_(storage, 0, (numel,), (1,))


def blocks_checksum(
    k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: Sequence[int] | torch.Tensor
) -> int:
    """32-bit checksum of blocks `block_ids` of a layer's K pool, then of its V pool.

    k_pool, v_pool: [num_blocks, block_size, num_kv_heads, head_dim] on a GPU. Reads the result
    back: a sync of the current stream (call it on a side stream)."""
    index = torch.as_tensor(block_ids, dtype=torch.int64).to(k_pool.device, non_blocking=True)
    total = torch.zeros((), dtype=torch.int64, device=k_pool.device)
    for i, pool in enumerate((k_pool, v_pool)):
        words = pool.index_select(0, index).reshape(-1).view(torch.int32).to(torch.int64)
        weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % 65521
        total = total * 31 + (words * (weights + 1 + i)).sum()
    return int(total) & 0xFFFFFFFF
