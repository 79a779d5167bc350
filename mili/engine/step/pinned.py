"""Host <-> device copies that never make the host wait for the device.

A copy from pageable memory, `torch.tensor(values, device="cuda")` or `.tolist()` of a CUDA
tensor each synchronize the host with the GPU: the host then stops launching the next kernels
until the device is idle. Here host data goes through pinned (page-locked) memory and
`non_blocking=True` copies, which the device runs in stream order while the host moves on;
the one wait of a step is `DeviceToHost.wait`, after everything is launched.

On CPU every function works the same with plain tensors: pinning and events are skipped and a
copy is done when it returns.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from mili.engine.step.byte_ring import ByteRing

_THREAD_STREAMS = threading.local()


def thread_stream(device: torch.device) -> torch.cuda.Stream:
    """The calling thread's own CUDA stream on `device`, made on first use: what a thread
    copies there (decode's landing threads into the cache, prefill's worker KV to the host)
    neither waits behind nor holds up the model's stream."""
    streams: dict[torch.device, torch.cuda.Stream] = _THREAD_STREAMS.__dict__.setdefault(
        "streams", {}
    )
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    return stream


def is_pinnable(device: torch.device) -> bool:
    """Whether host data bound for `device` goes through pinned memory (CUDA only)."""
    return device.type == "cuda"


def to_device(
    values: Sequence[int]
    | Sequence[float]
    | Sequence[Sequence[int]]
    | Sequence[Sequence[float]]
    | np.ndarray,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A tensor of `values` on `device`, copied from pinned memory without a host sync.

    The pinned buffer comes from torch's caching host allocator, which keeps it from being
    reused until the copy has run (it records the copy's stream), so no caller bookkeeping.
    """
    if isinstance(values, np.ndarray):
        # torch.tensor(array, dtype=...) converts element by element (~60 ns each: 8 ms for a
        # penalised batch's 131k ids); from_numpy shares the array, then one vectorised copy
        host = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
        if is_pinnable(device):
            host = host.pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=is_pinnable(device))
    return host.to(device, non_blocking=True)


class DeviceToHost:
    """Device tensors copied into pinned host memory, all behind one event.

    `wait()` blocks until the copies have landed (CUDA) and returns the host tensors.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        if tensors and tensors[0].device.type == "cuda":
            self._host = []
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                self._host.append(host)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tensors[0].device))
        else:
            self._host = [t.cpu() for t in tensors]  # CPU tensors: no copy at all

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host


class StagingRing:
    """Preallocated host memory (pinned for a CUDA `device`) for the KV hand-off's staging
    copies: prefill's device -> host copy of a layer for the grpc transport, decode's host ->
    device landing of one. Taken once at start, so no copy allocates (cudaHostAlloc per new
    size, with torch's caching host allocator) and staging is bounded.

    `empty` hands out a tensor on a span of the buffer; the span goes back to the ring when
    the tensor (and every view of it) is freed. Reuse is safe with respect to the device as
    long as each span's copies are over before it is freed or run in stream order with the
    next copies into it: prefill's copies all go on the worker's one side stream, and decode's
    landing threads wait for theirs before letting go.
    """

    def __init__(self, capacity_bytes: int, device: torch.device) -> None:
        self._ring = ByteRing(capacity_bytes)
        pinned = torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=is_pinnable(device))
        self._pinned = pinned  # owns the memory; the numpy view below shares it
        self._bytes = pinned.numpy()

    @property
    def num_held(self) -> int:
        """Spans handed out and not yet freed."""
        return self._ring.num_held

    @property
    def capacity(self) -> int:
        """Bytes of the buffer."""
        return self._ring.capacity

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised tensor of `shape` and `dtype` in the ring, or None while the ring
        has no room for it (the caller then allocates as before)."""
        num_bytes = math.prod(shape) * dtype.itemsize
        offset = self._ring.take(num_bytes) if num_bytes else None
        if offset is None:
            return None
        # The tensor's storage holds the span's numpy view (torch.frombuffer keeps its buffer
        # alive), and every view of the tensor holds that storage: the span is released once
        # the last of them is gone, not when the first tensor object is.
        span = self._bytes[offset : offset + num_bytes]
        weakref.finalize(span, self._ring.release, offset)
        return torch.frombuffer(span, dtype=dtype).view(shape)


def pinned_empty(
    shape: Sequence[int], dtype: torch.dtype, staging: StagingRing | None
) -> torch.Tensor:
    """Uninitialised pinned host memory: a span of `staging`, or torch's caching host
    allocator's where the ring has no room (or there is none)."""
    host = staging.empty(shape, dtype) if staging is not None else None
    return host if host is not None else torch.empty(shape, dtype=dtype, pin_memory=True)
