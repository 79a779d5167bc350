"""worker.hand_over: gathered blocks ([num_layers, 2, n, block_size, kv_heads, D]) as the KV
sink takes them. On the CPU as they are; from a GPU (-m gpu) as pinned host copies made on a
side stream, correct even when the gathered tensor is freed and its memory reused on the
model's stream right after the hand-over, and through a staging ring whose spans come round
again while older copies are still read. Also: the layer runs a hand-over gathers at once."""

from __future__ import annotations

import gc

import pytest
import torch

from mili.engine.step.pinned import StagingRing
from services.prefill.worker import _MAX_GATHER_BYTES, _layer_groups, hand_over


def test_cpu_blocks_are_handed_over_as_they_are() -> None:
    kv = torch.randn(1, 2, 3, 4, 2, 8)
    out, ready = hand_over(kv, takes_device_tensors=False)
    assert out is kv and ready is None


def test_layer_groups_cover_every_layer_once_within_the_gather_bound() -> None:
    assert _layer_groups(3, 4, 10) == [(3, 4)]
    assert _layer_groups(0, 28, 1 << 20) == [(0, 28)]  # 28 MB: one gather
    per_layer = _MAX_GATHER_BYTES // 3 + 1  # 3 layers would pass the bound, 2 do not
    groups = _layer_groups(0, 7, per_layer)
    assert groups == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert _layer_groups(0, 2, 4 * _MAX_GATHER_BYTES) == [(0, 1), (1, 2)]  # a layer at least


@pytest.mark.gpu
def test_gpu_blocks_reach_pinned_host_memory_intact() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    shape = (1, 2, 64, 16, 8, 128)  # 64 blocks of a 0.6B layer: 16 MB each for K and V (fp32)
    kv = torch.randn(shape, device="cuda")
    expected = kv.cpu()
    host, ready = hand_over(kv, takes_device_tensors=False)
    assert ready is not None
    assert host.is_pinned()
    # The model's stream goes on at once: kv is dropped and its memory (had the copy not
    # claimed it for its own stream) handed to the next kernels, which overwrite it.
    del kv
    for _ in range(4):
        torch.full(shape, 7.0, device="cuda")
    ready()
    torch.testing.assert_close(host, expected, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_blocks_stay_on_the_device_for_cuda_ipc() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kv = torch.randn(28, 2, 2, 16, 8, 128, device="cuda")
    out, ready = hand_over(kv, takes_device_tensors=True)
    assert out is kv
    assert ready is not None
    ready()


@pytest.mark.gpu
def test_gpu_blocks_are_staged_in_the_ring_and_its_spans_reused_in_stream_order() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    shape = (1, 2, 32, 16, 8, 128)  # 8 MB each for K and V in float32
    staging = StagingRing(64 << 20, torch.device("cuda"))
    base = staging.empty((1,), torch.uint8)  # the ring's first byte, to locate spans
    assert base is not None
    start = base.data_ptr()
    del base
    gc.collect()
    handed = []
    for i in range(6):  # 96 MB through a 64 MB ring: the first spans come round again
        kv = torch.full(shape, float(i), device="cuda")
        kv[:, 1] = -i
        host, ready = hand_over(kv, False, staging)
        assert host.is_pinned() and start <= host.data_ptr() < start + (64 << 20)
        handed.append((i, host, ready))
        if len(handed) == 2:  # a sender reads the oldest, then lets it go
            j, old, ready_old = handed.pop(0)
            ready_old()
            assert torch.all(old[:, 0] == j) and torch.all(old[:, 1] == -j)
            del old
            gc.collect()
    for j, host, ready in handed:
        ready()
        assert torch.all(host[:, 0] == j) and torch.all(host[:, 1] == -j)
