"""How many KV blocks an engine gets: the flags, else device memory (CUDA), else a default.

Pure: the device's numbers come in as a DeviceMemory (the runner measures them after loading
the weights and running one warm-up at the largest batch), so the arithmetic is tested with
made-up numbers. On CUDA, without --num-blocks or --kv-cache-bytes:

    budget     = total x utilization - peak        the share this process may fill, minus the
                                                   most it held at once without a KV pool
                                                   (weights + the warm-up's activations)
    available  = free - (peak - in_use)            what is free now, minus the activations
                                                   that must fit again later
    KV bytes   = min(budget, available)            available is smaller only when another
                                                   process holds memory this share counted on

    e.g. 80 GiB x 0.9 - 1.5 GiB peak (1.2 GiB of weights) = 70.5 GiB of KV
"""

from __future__ import annotations

from typing import NamedTuple

from mili.engine.engine_config import EngineConfig

GIB = 1 << 30


class DeviceMemory(NamedTuple):
    """Bytes of one device, as seen by this process after its warm-up."""

    total_bytes: int  # the device's memory
    free_bytes: int  # free on the device now, this process's caches emptied
    peak_bytes: int  # the most this process held at once (weights + activations), no KV pool
    in_use_bytes: int  # what this process holds now (the weights)


class KvPoolSize(NamedTuple):
    num_blocks: int
    num_bytes: int  # num_blocks x bytes per block
    reason: str  # how the size was chosen, for the start-up log


def kv_bytes_from_memory(memory: DeviceMemory, utilization: float) -> int:
    """KV pool bytes for this process (see the module docstring); 0 when nothing is left."""
    budget = int(memory.total_bytes * utilization) - memory.peak_bytes
    available = memory.free_bytes - (memory.peak_bytes - memory.in_use_bytes)
    return max(0, min(budget, available))


def check_weights_fit(
    weight_bytes: int, total_bytes: int, utilization: float, *, what: str, device: str
) -> None:
    """ValueError, saying how much is needed, when `weight_bytes` alone exceed this process's
    share of the device (total x utilization): such a model can never serve here, and
    finding out before loading saves minutes and an out-of-memory error mid-load. What fits
    still has to leave room for activations and KV; `plan_kv_pool` sizes that after loading.
    """
    share = int(total_bytes * utilization)
    if weight_bytes <= share:
        return
    raise ValueError(
        f"{what} needs {weight_bytes / GIB:.1f} GiB for its weights alone, more than "
        f"{device}'s {share / GIB:.1f} GiB ({utilization:g} x {total_bytes / GIB:.1f} GiB): "
        f"it needs a device with at least {weight_bytes / utilization / GIB:.1f} GiB at "
        "this --gpu-memory-utilization (plus room for activations and KV), or a smaller model"
    )


def plan_kv_pool(
    config: EngineConfig,
    bytes_per_block: int,
    *,
    memory: DeviceMemory | None,
    default_bytes: int | None = None,
    default_num_blocks: int | None = None,
    max_useful_blocks: int | None = None,
) -> KvPoolSize:
    """The pool: --num-blocks, else --kv-cache-bytes, else from `memory` (CUDA), else the
    service's default (`default_num_blocks`, else `default_bytes`).

    `max_useful_blocks` caps a memory-derived pool where more blocks could never be used (a
    prefill instance holds at most its queue's prompts). ValueError when the pool holds no
    block, naming what to change.
    """
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be > 0, got {bytes_per_block}")
    if config.num_blocks is not None:
        num_blocks, reason = config.num_blocks, "--num-blocks"
    elif config.kv_cache_bytes is not None:
        num_blocks = config.kv_cache_bytes // bytes_per_block
        reason = f"--kv-cache-bytes {config.kv_cache_bytes}"
    elif memory is not None:
        kv_bytes = kv_bytes_from_memory(memory, config.gpu_memory_utilization)
        num_blocks = kv_bytes // bytes_per_block
        reason = (
            f"{config.gpu_memory_utilization:g} x {memory.total_bytes / GIB:.2f} GiB total "
            f"- {memory.peak_bytes / GIB:.2f} GiB peak ({memory.in_use_bytes / GIB:.2f} GiB "
            f"held), {memory.free_bytes / GIB:.2f} GiB free"
        )
        if max_useful_blocks is not None and num_blocks > max_useful_blocks:
            num_blocks = max_useful_blocks
            reason += f"; capped at the {max_useful_blocks} blocks this instance can use"
        if num_blocks == 0:
            raise ValueError(
                f"no memory left for KV blocks ({reason}); raise --gpu-memory-utilization, "
                "or give --num-blocks / --kv-cache-bytes"
            )
    elif default_num_blocks is not None:
        num_blocks, reason = default_num_blocks, "the default"
    elif default_bytes is not None:
        num_blocks = default_bytes // bytes_per_block
        reason = f"the default of {default_bytes} bytes"
    else:
        raise ValueError("no KV pool size: give --num-blocks or --kv-cache-bytes")
    if num_blocks <= 0:
        raise ValueError(f"{reason} holds no KV block of this model ({bytes_per_block} bytes each)")
    return KvPoolSize(num_blocks, num_blocks * bytes_per_block, reason)
