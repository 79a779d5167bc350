"""A KV pool on a GPU shared with another process through CUDA IPC (transport "cuda-ipc").

Decode allocates its pool as one flat device tensor (see `kv_cache.pool_views` for the
order: per layer, K then V), exports it once with torch's CUDA IPC export (the one
torch.multiprocessing sends: a cudaIpcMemHandle of the allocation, the pool's offset in it, and
the reference-counter and event handles torch uses to keep it alive); prefill maps it once per
pair and copies prompt blocks device to device on a side stream.

Integrity: `chunk_checksums` runs on the device on both sides over the blocks as they are (a
position-weighted sum of 32-bit words, wrapping: integer arithmetic, so equal on any GPU in any
order), read back once per batch of chunks on the caller's own stream, never the model's.

Written for the GPU host; tests/prefill/test_cuda_ipc.py (-m gpu) checks the transport there.
The checksum is plain torch: tests/kv_handoff/test_chunk_checksums.py checks it on the CPU.
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


# Word weights repeat with this period (the largest prime below 2^16), so a position's weight
# is the same however the blocks are split into chunks of a chunk's side.
_PERIOD = 65521
_weights: dict[torch.device, torch.Tensor] = {}  # per device: (arange % _PERIOD) + 1, int32


def _word_weights(device: torch.device, n: int) -> torch.Tensor:
    """The first `n` word weights, int32 on `device` (grown as needed, kept: a transfer's
    checksums cost no arange)."""
    table = _weights.get(device)
    if table is None or table.numel() < n:
        size = max(n, 2 * (0 if table is None else table.numel()))
        table = torch.arange(size, dtype=torch.int64, device=device) % _PERIOD + 1
        table = table.to(torch.int32)
        if device.type == "cuda":  # made on this thread's stream; others read it on theirs
            torch.cuda.current_stream(device).synchronize()
        _weights[device] = table  # a racing thread's table is as good: the same values
    return table[:n]


def chunk_checksums(chunks: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[int]:
    """The 32-bit checksum of each chunk's blocks; one read back for all of them.

    chunks: (k_pool, v_pool, block_ids) per chunk: the layer's pools [num_blocks, block_size,
    num_kv_heads, head_dim] and the blocks' ids (int64, on the pools' device). A chunk's value
    is sum(x * (p % 65521 + 1 + side)) over the 32-bit words x at position p of its K blocks
    (side 0), times 31, plus the same over its V blocks (side 1), modulo 2^32: integer
    arithmetic, so equal on any device in any order. Products wrap in int32 (their low 32 bits
    are all the result keeps); sums accumulate in int64. About ten launches a chunk, and one
    sync of the current stream at the end (call it on a side stream, never the model's)."""
    values: list[torch.Tensor] = []
    for k_pool, v_pool, ids in chunks:
        k_words, v_words = (
            p.index_select(0, ids).reshape(-1).view(torch.int32) for p in (k_pool, v_pool)
        )
        weights = _word_weights(k_words.device, k_words.numel())
        k_sum = (k_words * weights).sum(dtype=torch.int64)
        # V's weights are K's plus one: its weighted sum and its plain sum once more.
        v_sum = (v_words * weights).sum(dtype=torch.int64) + v_words.sum(dtype=torch.int64)
        values.append(k_sum * 31 + v_sum)
    if not values:
        return []
    return [v & 0xFFFFFFFF for v in torch.stack(values).tolist()]
