"""KV pool sizing (mili.engine.kv_memory) with made-up device numbers, and the shared flags."""

from __future__ import annotations

import argparse

import pytest

from mili.engine.engine_config import EngineConfig, add_engine_arguments
from mili.engine.kv_memory import GIB, DeviceMemory, kv_bytes_from_memory, plan_kv_pool

MIB = 1 << 20
BLOCK = 2 * MIB  # bytes per block in these tests


def test_memory_budget_is_total_times_utilization_minus_peak() -> None:
    # 80 GiB device, 1.2 GiB of weights, 1.5 GiB peak with the warm-up's activations.
    memory = DeviceMemory(
        total_bytes=80 * GIB,
        free_bytes=78 * GIB,
        peak_bytes=int(1.5 * GIB),
        in_use_bytes=int(1.2 * GIB),
    )
    assert kv_bytes_from_memory(memory, 0.9) == int(80 * GIB * 0.9) - int(1.5 * GIB)
    size = plan_kv_pool(EngineConfig(device="cuda"), BLOCK, memory=memory)
    assert size.num_blocks == (int(80 * GIB * 0.9) - int(1.5 * GIB)) // BLOCK
    assert size.num_bytes == size.num_blocks * BLOCK
    assert "0.9 x 80.00 GiB total - 1.50 GiB peak" in size.reason


def test_another_process_on_the_device_leaves_less() -> None:
    # Only 10 GiB free: the activations (0.3 GiB over the weights) must fit again later.
    memory = DeviceMemory(80 * GIB, 10 * GIB, int(1.5 * GIB), int(1.2 * GIB))
    assert kv_bytes_from_memory(memory, 0.9) == 10 * GIB - (int(1.5 * GIB) - int(1.2 * GIB))
    # Two services each given half of a device: the second sees what the first took.
    half = DeviceMemory(80 * GIB, 80 * GIB - 38 * GIB, 2 * GIB, 1 * GIB)
    assert kv_bytes_from_memory(half, 0.45) == int(80 * GIB * 0.45) - 2 * GIB


def test_nothing_left_is_an_error_naming_the_flags() -> None:
    memory = DeviceMemory(8 * GIB, 8 * GIB, 8 * GIB, 7 * GIB)
    assert kv_bytes_from_memory(memory, 0.5) == 0
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        plan_kv_pool(EngineConfig(device="cuda", gpu_memory_utilization=0.5), BLOCK, memory=memory)


def test_flags_win_over_memory_and_defaults() -> None:
    memory = DeviceMemory(80 * GIB, 80 * GIB, GIB, GIB)
    by_blocks = plan_kv_pool(EngineConfig(num_blocks=7), BLOCK, memory=memory, default_bytes=GIB)
    assert (by_blocks.num_blocks, by_blocks.reason) == (7, "--num-blocks")
    by_bytes = plan_kv_pool(EngineConfig(kv_cache_bytes=5 * BLOCK + 1), BLOCK, memory=memory)
    assert by_bytes.num_blocks == 5
    # CPU: no memory numbers, the service's default.
    assert plan_kv_pool(EngineConfig(), BLOCK, memory=None, default_bytes=GIB).num_blocks == 512
    assert plan_kv_pool(EngineConfig(), BLOCK, memory=None, default_num_blocks=9).num_blocks == 9
    with pytest.raises(ValueError, match="holds no KV block"):
        plan_kv_pool(EngineConfig(kv_cache_bytes=BLOCK - 1), BLOCK, memory=None)


def test_a_memory_sized_pool_is_capped_where_more_could_never_be_used() -> None:
    memory = DeviceMemory(80 * GIB, 80 * GIB, GIB, GIB)
    size = plan_kv_pool(EngineConfig(device="cuda"), BLOCK, memory=memory, max_useful_blocks=64)
    assert size.num_blocks == 64 and "capped" in size.reason
    # The cap never applies to an explicit size.
    explicit = plan_kv_pool(EngineConfig(num_blocks=100), BLOCK, memory=None, max_useful_blocks=64)
    assert explicit.num_blocks == 100


def test_engine_flags_parse_into_one_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, default_pool="1 GiB")
    args = parser.parse_args(
        ["--device", "cuda:0", "--gpu-memory-utilization", "0.45", "--enforce-eager"]
    )
    config = EngineConfig.from_args(args)
    assert config == EngineConfig(device="cuda:0", gpu_memory_utilization=0.45, enforce_eager=True)
    assert config.is_cuda and not EngineConfig().is_cuda
    with pytest.raises(SystemExit):  # one size flag at most
        parser.parse_args(["--num-blocks", "4", "--kv-cache-bytes", "4096"])
    for bad in ({"gpu_memory_utilization": 0.0}, {"device": "tpu"}, {"block_size": 0}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)  # type: ignore[arg-type]
