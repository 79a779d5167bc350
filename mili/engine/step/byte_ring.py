"""Spans of one fixed buffer handed out in ring order (pure bookkeeping, no tensors).

    capacity  [ .... live spans, oldest at `tail` .... | free ...... ]
                     ^tail                               ^head (next span starts here)

A span is taken at `head`; when the end of the buffer is too close it is taken from offset 0
instead (the gap at the end is skipped until the ring drains past it). Spans may be released in
any order, but room comes back only as the oldest ones are released: a span held for long
keeps the ring from reusing what follows it. That suits staging buffers, which live for one
copy each; a caller that finds the ring full (`take` returns None) allocates elsewhere.

`release` may be called back from inside the ring's own lock, on the thread holding it: a
staging span's release is a finalizer, and the garbage collector runs finalizers of cyclic
garbage wherever an allocation triggers it (inside `take`, say). Such a release is deferred to
the end of that locked section instead of waiting for the lock forever.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

from mili.arith import ceil_div

_ALIGN = 64  # bytes: every span starts on a cache line


class ByteRing:
    """Offsets into a buffer of `capacity` bytes; thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        # spans not reclaimed yet, in the order taken: offset -> size
        self._spans: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._released: set[int] = set()  # of those, the ones given back (not the oldest)
        self._head = 0
        self._owner: int | None = None  # the thread holding the lock
        self._deferred: collections.deque[int] = collections.deque()  # released from inside it

    def take(self, num_bytes: int) -> int | None:
        """The offset of `num_bytes` (> 0) free bytes, now held; None when the ring has no such
        room until older spans are released (or never, for more than `capacity`)."""
        if num_bytes <= 0:
            raise ValueError(f"a span needs at least one byte, got {num_bytes}")
        size = ceil_div(num_bytes, _ALIGN) * _ALIGN
        with self._locked():
            offset = self._place(size)
            if offset is not None:
                self._spans[offset] = size
                self._head = offset + size
            return offset

    def release(self, offset: int) -> None:
        """Give back the span at `offset`; raises KeyError for one not held (unless deferred:
        called back from inside the ring's lock, see the module docstring)."""
        if self._owner == threading.get_ident():
            self._deferred.append(offset)  # the locked section under us finishes it
            return
        with self._locked():
            self._release(offset)

    @property
    def num_held(self) -> int:
        """Spans taken and not released."""
        with self._locked():
            return len(self._spans) - len(self._released)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock, noting its owner; releases deferred meanwhile are done before leaving."""
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
                while self._deferred:
                    self._release(self._deferred.popleft())
            finally:
                self._owner = None

    def _release(self, offset: int) -> None:
        if offset not in self._spans or offset in self._released:
            raise KeyError(f"no span held at {offset}")
        self._released.add(offset)
        while self._spans and (oldest := next(iter(self._spans))) in self._released:
            self._released.remove(oldest)
            del self._spans[oldest]
        if not self._spans:
            self._head = 0  # drained: start again at the front, no gap to skip

    def _place(self, size: int) -> int | None:
        if not self._spans:
            return 0 if size <= self.capacity else None
        tail = next(iter(self._spans))
        if self._head > tail:  # live spans in [tail, head): free at the end, then the front
            if self.capacity - self._head >= size:
                return self._head
            return 0 if tail >= size else None
        # wrapped: live spans in [tail, capacity) and [0, head); free only [head, tail)
        return self._head if tail - self._head >= size else None
