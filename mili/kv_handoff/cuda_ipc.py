"""A KV pool on a GPU shared with another process through CUDA IPC (transport "cuda-ipc").

Decode allocates its pool as one flat device tensor (see `kv_cache.pool_views` for the
order: per layer, K then V), exports it once with torch's CUDA IPC export (the one
torch.multiprocessing sends: a cudaIpcMemHandle of the allocation, the pool's offset in it, and
the reference-counter and event handles torch uses to keep it alive); prefill maps it once per
pair and copies prompt blocks device to device on a side stream.

Integrity: a position-weighted sum of 32-bit words per chunk (wrapping: integer arithmetic, so
equal on any GPU in any order), computed on the device: prefill's over the KV it copied
(`kv_checksums`), decode's over its blocks as they are (`chunk_checksums`), each read back once
per batch of chunks on the caller's own stream, never the model's.

Written for the GPU host; tests/prefill/test_cuda_ipc.py (-m gpu) checks the transport there.
The checksums are plain torch: tests/kv_handoff/test_chunk_checksums.py checks them on the CPU.
"""

from __future__ import annotations

import json
import os
import threading
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
            # Who exports it: a peer in the same pid namespace can tell when this process is
            # gone (a decode restarted on the same address exports a new pool; see `owner`).
            "pid": os.getpid(),
            "pid_ns": _pid_namespace(),
        }
    ).encode()


def owner(blob: bytes) -> int | None:
    """The exporting process's pid, when this process can check on it (same pid namespace);
    None when it cannot (another namespace, or the export does not say)."""
    try:
        d = json.loads(blob)
        pid, namespace = int(d["pid"]), d["pid_ns"]
    except (KeyError, TypeError, ValueError):
        return None
    return pid if namespace and namespace == _pid_namespace() else None


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def import_pool(blob: bytes) -> torch.Tensor:
    """The exporter's flat pool, mapped here (ValueError on a malformed export)."""
    torch.cuda._lazy_init()  # as torch's own rebuild_cuda_tensor does before mapping
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
# per device: [2 (K, V), n] int32, K's row 31 * (p % _PERIOD + 1), V's p % _PERIOD + 2
_weights: dict[torch.device, torch.Tensor] = {}
# Tables a larger one replaced, never freed: another thread's stream may still be reading one
# (the caching allocator would hand its memory out again at once). A few, early in a process.
_retired: list[torch.Tensor] = []
_lock = threading.Lock()
_MAX_RUN_BYTES = 64 << 20  # KV one checksum pass multiplies at once (see kv_checksums)


def _word_weights(device: torch.device, n: int) -> torch.Tensor:
    """The weights of a chunk's first `n` words on each side, [2, n] int32 on `device` (grown
    as needed, kept: a transfer's checksums cost no arange). K's carry the 31 its side sum is
    multiplied by, V's the plain sum added to it, so that one product and one sum make a
    chunk's value."""
    table = _weights.get(device)
    if table is None or table.shape[1] < n:
        size = max(n, 2 * (0 if table is None else table.shape[1]))
        base = torch.arange(size, dtype=torch.int64, device=device) % _PERIOD + 1
        table = torch.stack([base * 31, base + 1]).to(torch.int32)
        if device.type == "cuda":  # made on this thread's stream; others read it on theirs
            torch.cuda.current_stream(device).synchronize()
        with _lock:  # a racing thread's table is as good: the same values
            if device in _weights:
                _retired.append(_weights[device])
            _weights[device] = table
    return table[:, :n]


def kv_checksums(parts: Sequence[torch.Tensor]) -> list[int]:
    """The 32-bit checksum of each layer of each part, a chunk being one layer's; one read
    back for all of them.

    parts: KV as a transfer hands it over, [num_layers, 2 (K, V), num_blocks, block_size,
    num_kv_heads, head_dim] (a gather of the blocks in the transfer's order); one value per
    layer of each part, in order. A chunk's value is sum(x * (p % 65521 + 1 + side)) over the
    32-bit words x at position p of its K blocks (side 0), times 31, plus the same over its V
    blocks (side 1), modulo 2^32: integer arithmetic, so equal on any device in any order.
    Computed as one sum of products with weights that fold in the 31 and the side (products
    wrap in int32: their low 32 bits are all the result keeps; sums accumulate in int64). Two
    launches a pass of up to _MAX_RUN_BYTES, and one sync of the current stream at the end
    (call it on a side stream, never the model's)."""
    values: list[torch.Tensor] = []
    for kv in parts:
        for start, step in _passes(kv.shape[0], kv[0].numel() * kv.element_size()):
            values.append(_layer_values(kv[start : start + step]))
    return _read_back(values)


def chunk_checksums(runs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """kv_checksums of blocks where they are: runs of (blocks, block_ids), blocks [num_layers,
    2, num_blocks, block_size, num_kv_heads, head_dim] (a slice of `kv_cache.pool_blocks`'
    view), ids int64 on its device; one value per layer of each run, in order. A pass's
    gather is one launch more, and a temporary as large as its products."""
    values: list[torch.Tensor] = []
    for blocks, ids in runs:
        layer_bytes = 2 * ids.numel() * blocks[0, 0, 0].numel() * blocks.element_size()
        for start, step in _passes(blocks.shape[0], layer_bytes):
            values.append(_layer_values(blocks[start : start + step].index_select(2, ids)))
    return _read_back(values)


def _passes(num_layers: int, layer_bytes: int) -> list[tuple[int, int]]:
    """(first layer, number of layers) of each pass over `num_layers` layers of `layer_bytes`
    each: at most _MAX_RUN_BYTES a pass (the products are a temporary as large), a layer at
    least."""
    step = max(1, _MAX_RUN_BYTES // max(1, layer_bytes))
    return [(start, min(step, num_layers - start)) for start in range(0, num_layers, step)]


def _layer_values(kv: torch.Tensor) -> torch.Tensor:
    """kv [num_layers, 2, ...] -> its layers' checksums before the final modulo, [num_layers]
    int64 (on kv's device, not read back)."""
    words = kv.contiguous().reshape(kv.shape[0], 2, -1).view(torch.int32)
    weights = _word_weights(words.device, words.shape[2])
    return (words * weights).sum(dim=(1, 2), dtype=torch.int64)


def _read_back(values: list[torch.Tensor]) -> list[int]:
    if not values:
        return []
    joined = values[0] if len(values) == 1 else torch.cat(values)
    return [v & 0xFFFFFFFF for v in joined.tolist()]
