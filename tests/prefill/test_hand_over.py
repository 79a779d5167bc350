"""worker.hand_over: a layer's gathered blocks as the KV sink takes them. On the CPU as they are;
from a GPU (-m gpu) as pinned host copies made on a side stream, correct even when the gathered
tensors are freed and their memory reused on the model's stream right after the hand-over, and
through a staging ring whose spans come round again while older copies are still read."""

from __future__ import annotations

import gc

import pytest
import torch

from mili.engine.step.pinned import StagingRing
from services.prefill.worker import hand_over


def test_cpu_blocks_are_handed_over_as_they_are() -> None:
    k, v = torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 8)
    k_out, v_out, ready = hand_over(k, v, takes_device_tensors=False)
    assert (k_out, v_out, ready) == (k, v, None)


@pytest.mark.gpu
def test_gpu_blocks_reach_pinned_host_memory_intact() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    shape = (64, 16, 8, 128)  # 64 blocks of a 0.6B layer: 16 MB each for K and V in float32
    k = torch.randn(shape, device="cuda")
    v = torch.randn(shape, device="cuda")
    expected = (k.cpu(), v.cpu())
    k_host, v_host, ready = hand_over(k, v, takes_device_tensors=False)
    assert ready is not None
    assert k_host.is_pinned() and v_host.is_pinned()
    # The model's stream goes on at once: k and v are dropped and their memory (had the copy
    # not claimed it for its own stream) handed to the next kernels, which overwrite it.
    del k, v
    for _ in range(4):
        torch.full(shape, 7.0, device="cuda")
    ready()
    torch.testing.assert_close(k_host, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(v_host, expected[1], rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_blocks_stay_on_the_device_for_cuda_ipc() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    k, v = torch.randn(2, 16, 8, 128, device="cuda"), torch.randn(2, 16, 8, 128, device="cuda")
    k_out, v_out, ready = hand_over(k, v, takes_device_tensors=True)
    assert (k_out, v_out) == (k, v)
    assert ready is not None
    ready()


@pytest.mark.gpu
def test_gpu_blocks_are_staged_in_the_ring_and_its_spans_reused_in_stream_order() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    shape = (32, 16, 8, 128)  # 8 MB each for K and V in float32
    staging = StagingRing(64 << 20, torch.device("cuda"))
    base = staging.empty((1,), torch.uint8)  # the ring's first byte, to locate spans
    assert base is not None
    start = base.data_ptr()
    del base
    gc.collect()
    handed = []
    for i in range(6):  # 96 MB through a 64 MB ring: the first spans come round again
        k = torch.full(shape, float(i), device="cuda")
        v = torch.full(shape, float(-i), device="cuda")
        k_host, v_host, ready = hand_over(k, v, False, staging)
        assert k_host.is_pinned() and start <= k_host.data_ptr() < start + (64 << 20)
        handed.append((i, k_host, v_host, ready))
        if len(handed) == 2:  # a sender reads the oldest, then lets it go
            j, k_old, v_old, ready_old = handed.pop(0)
            ready_old()
            assert torch.all(k_old == j) and torch.all(v_old == -j)
            del k_old, v_old
            gc.collect()
    for j, k_host, v_host, ready in handed:
        ready()
        assert torch.all(k_host == j) and torch.all(v_host == -j)
