"""Giving freed heap memory back to the operating system after large requests.

grpc reads a request message whole before a deserializer sees it (only the server's one receive
limit refuses from the length prefix, see mili.rpc.policy), into many small buffers, and
parsing a large one makes many more. Freed, they stay in the C heap as resident memory: 16
concurrent 60 MB requests refused from their size left a bare grpc server 581 MB larger, for
good, and 16 refused 7.5 MB token_ids lists the frontend 273 MB larger. `release_soon` runs
glibc's malloc_trim once a burst of large requests is over (no new one for _QUIET_S, or
_MAX_WAIT_S after the first), and once more _SETTLE_S later: a request's buffers are freed when
its handler is done with them, which can be after the trim its arrival asked for (16 refused
7.5 MB lists took 2 s on 2 busy cores, and the frontend kept 418 MB). It runs on a thread of its
own: the event loop keeps running while it walks the heap (milliseconds). On other C
libraries it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections.abc import Callable

# A request message at least this large (and not one of a stream: KV chunks are megabytes
# every few milliseconds) calls for a trim once its burst is over.
LARGE_REQUEST_BYTES = 1 << 20
_QUIET_S = 0.5  # the requests of one burst share a trim ...
_MAX_WAIT_S = 2.0  # ... but a steady stream of them still gets one this often
_SETTLE_S = 3.0  # then once more, for what the burst's handlers freed after it


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc
        return None
    return trim


_TRIM = _malloc_trim()
_lock = threading.Lock()
_first: float | None = None  # when the pending trim was asked for; None: none pending
_last = 0.0  # the latest request for it


def release_soon() -> None:
    """Give the C heap's free memory back to the OS once this burst of large requests is over."""
    global _first, _last
    if _TRIM is None:
        return
    now = time.monotonic()
    with _lock:
        _last = now
        if _first is not None:
            return  # the pending trim waits for this one too
        _first = now
    threading.Thread(target=_release, name="heap-trim", daemon=True).start()


def _release() -> None:
    global _first
    while True:
        _wait_for_quiet()
        started = time.monotonic()
        assert _TRIM is not None
        _TRIM(0)
        time.sleep(_SETTLE_S)
        _TRIM(0)
        with _lock:
            if _last < started:
                _first = None
                return
            _first = time.monotonic()  # large requests came meanwhile: their own round


def _wait_for_quiet() -> None:
    """Until no large request came for _QUIET_S, or _MAX_WAIT_S after the round's first."""
    while True:
        with _lock:
            assert _first is not None
            wait_s = min(_last + _QUIET_S, _first + _MAX_WAIT_S) - time.monotonic()
        if wait_s <= 0:
            return
        time.sleep(wait_s)
