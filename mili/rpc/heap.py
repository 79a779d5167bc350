"""Giving freed heap memory back to the operating system after a large refused request.

grpc reads a request message whole before a deserializer sees it (only the server's one receive
limit refuses from the length prefix, see mili.rpc.policy), into many small buffers. Freed,
they stay in the C heap as resident memory: 16 concurrent 60 MB requests refused by their
method's limit left a decode process ~580 MB larger, for good. `release_soon` runs glibc's
malloc_trim once, shortly after a burst of such refusals, on a timer thread (it takes
milliseconds, and the event loop keeps running meanwhile); on other C libraries it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

_LOG = logging.getLogger("mili.rpc")
_DELAY_S = 0.2  # the refusals of one burst share a trim


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc
        return None
    return trim


_TRIM = _malloc_trim()
_lock = threading.Lock()
_is_pending = False


def release_soon() -> None:
    """Return the C heap's free memory to the OS within _DELAY_S (one trim per burst)."""
    global _is_pending
    if _TRIM is None:
        return
    with _lock:
        if _is_pending:
            return
        _is_pending = True
    timer = threading.Timer(_DELAY_S, _release)
    timer.daemon = True
    timer.start()


def _release() -> None:
    global _is_pending
    with _lock:
        _is_pending = False
    assert _TRIM is not None
    _TRIM(0)
    _LOG.debug("gave freed heap memory back after a refused oversized request")
