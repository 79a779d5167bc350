"""mili.engine.step.byte_ring: spans of one buffer in ring order, and the staging ring on top of it
(mili.engine.pinned.StagingRing, here on the CPU: the same code without pinning)."""

from __future__ import annotations

import gc
import random
import threading
import weakref

import pytest
import torch

from mili.engine.step.byte_ring import ByteRing
from mili.engine.step.pinned import StagingRing


def test_spans_are_taken_in_order_and_aligned():
    ring = ByteRing(1024)
    assert ring.take(100) == 0
    assert ring.take(1) == 128  # 100 bytes rounded up to two 64-byte lines
    assert ring.take(64) == 192
    assert ring.num_held == 3


def test_full_ring_refuses_until_the_oldest_span_returns():
    ring = ByteRing(256)
    first, second = ring.take(128), ring.take(128)
    assert ring.take(64) is None
    ring.release(second)  # not the oldest: its room follows a held span, nothing comes back
    assert ring.take(64) is None
    ring.release(first)  # drained: from the front again
    assert ring.num_held == 0
    assert ring.take(256) == 0


def test_wraps_to_the_front_when_the_end_is_too_small():
    ring = ByteRing(512)
    a, b, c = ring.take(192), ring.take(192), ring.take(64)
    ring.release(a)
    assert ring.take(128) == 0  # 64 bytes left at the end: the span goes to the front
    assert ring.take(64) == 128  # then up to the oldest live span (b at 192)
    assert ring.take(64) is None
    ring.release(b)
    ring.release(c)
    assert ring.take(256) == 192  # b's and c's room, after the front spans


def test_a_span_larger_than_the_ring_is_refused():
    ring = ByteRing(256)
    assert ring.take(257) is None
    with pytest.raises(ValueError):
        ring.take(0)


def test_releasing_a_span_twice_or_one_never_taken_raises():
    ring = ByteRing(256)
    offset = ring.take(64)
    ring.take(64)
    ring.release(offset)
    with pytest.raises(KeyError):
        ring.release(offset)
    with pytest.raises(KeyError):
        ring.release(999)


def test_live_spans_never_overlap_under_random_use():
    rng = random.Random(0)
    capacity = 4096
    ring = ByteRing(capacity)
    live: dict[int, int] = {}
    taken = 0
    for _ in range(5000):
        if live and rng.random() < 0.5:
            offset = rng.choice(list(live))
            del live[offset]
            ring.release(offset)
            continue
        size = rng.randint(1, 1500)
        offset = ring.take(size)
        if offset is None:
            continue
        taken += 1
        assert offset % 64 == 0 and offset + size <= capacity
        for other, other_size in live.items():
            assert offset + size <= other or other + other_size <= offset
        live[offset] = size
        assert ring.num_held == len(live)
    assert taken > 1000  # the ring kept handing out room, not just refusing


def test_staging_ring_tensors_lie_in_the_ring_and_come_back_when_freed():
    staging = StagingRing(1 << 16, torch.device("cpu"))
    k = staging.empty((4, 16, 2, 64), torch.bfloat16)  # 16 KiB
    v = staging.empty((4, 16, 2, 64), torch.bfloat16)
    assert k is not None and v is not None
    assert k.shape == (4, 16, 2, 64) and k.dtype == torch.bfloat16
    k.fill_(1.5)
    v.fill_(-2.0)
    assert torch.all(k == 1.5) and torch.all(v == -2.0)  # two spans, no overlap
    assert staging.num_held == 2
    rows = k.view(4, -1)[1:3]  # a view outlives the tensor it came from
    del k
    gc.collect()
    assert staging.num_held == 2
    assert torch.all(rows == 1.5)
    del rows, v
    gc.collect()
    assert staging.num_held == 0


def test_staging_ring_says_none_when_full_so_the_caller_allocates_elsewhere():
    staging = StagingRing(4096, torch.device("cpu"))
    held = staging.empty((1024,), torch.float32)  # all of it
    assert held is not None
    assert staging.empty((1,), torch.float32) is None
    del held
    gc.collect()
    assert staging.empty((1024,), torch.float32) is not None


class _CollectingRing(ByteRing):
    """A ring whose placement runs the garbage collector, as any allocation inside its locked
    section may (Python runs the collector wherever it comes due)."""

    def _place(self, size: int) -> int | None:
        gc.collect()
        return super()._place(size)


def test_a_release_the_collector_runs_inside_the_ring_lock_is_deferred_not_deadlocked():
    """A staging span's release is a finalizer: the collector may run it on the thread that
    holds the ring's lock, inside `take`. It waits for the end of that section; before, that
    thread waited for its own lock forever."""
    ring = _CollectingRing(1024)
    first = ring.take(64)
    doomed = ring.take(64)

    class Cycle:
        me: object

    garbage = Cycle()
    garbage.me = garbage  # freed only by the collector
    weakref.finalize(garbage, ring.release, doomed)
    del garbage
    taken: list[int | None] = []
    thread = threading.Thread(target=lambda: taken.append(ring.take(64)), daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "take() deadlocked on the ring's own lock"
    assert taken == [128]
    assert ring.num_held == 2  # first and the new span; `doomed` came back
    ring.release(first)
    assert ring.num_held == 1
    with pytest.raises(KeyError):
        ring.release(doomed)  # released once already, by its finalizer
