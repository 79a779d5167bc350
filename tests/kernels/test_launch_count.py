"""Kernels launched per decoder layer in one decode step: at most 14 with the Mojo kernels.

Counted as torch operators that do work (seen by a TorchDispatchMode below composite ops such
as `linear`, so each counted op is one kernel; views and bare allocations launch none) plus the
Mojo kernel calls the bindings count. torch.profiler records composite ops *and* what they
decompose into, so its event count cannot be read as kernels without a list of which nest in
which; the dispatch mode sees exactly the ops that run. Per layer = (count for a 3-layer model)
- (count for a 2-layer model): embeddings, final norm and head cancel out.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import build
from kernels.cpu import CpuKernels
from kernels.fused.cpu import CpuFusedKernels
from mili.engine.model.attention import TorchAttention
from mili.engine.model.checkpoint import write_random_checkpoint
from mili.engine.model.config import Qwen3Config
from mili.engine.model.fused_ops import TorchFusedOps
from mili.engine.model.kv_cache import KVCache
from mili.engine.model.loader import load_model
from mili.engine.model.qwen3 import DecodeBatch, PrefillBatch

MAX_KERNELS_PER_LAYER = 14
BLOCK_SIZE = 16
# No kernel: memory without a fill (the kernel that writes it is counted).
ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.empty_strided.default,
}


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view and func not in ALLOCATIONS:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _config(num_layers: int) -> Qwen3Config:
    # Qwen3-0.6B's head layout (16 q heads, 8 kv heads, head_dim 128), narrower.
    return Qwen3Config(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=num_layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=512,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )


def _kernels_per_step(path: Path, kind: str) -> tuple[int, Counter[str]]:
    """(kernels, torch ops by name) of one decode step of 3 sequences."""
    module_path = build.build_cpu()
    attention_kernels = CpuKernels.from_path(module_path)
    fused = CpuFusedKernels.from_path(module_path)
    if kind == "mojo":
        model = load_model(path, attention=attention_kernels, fused_ops=fused)
    else:
        model = load_model(path, attention=TorchAttention(), fused_ops=TorchFusedOps())
    cache = KVCache(model.config, 8, BLOCK_SIZE, dtype=model.dtype)
    tables = [[0], [1, 2], [3]]
    model.prefill(PrefillBatch.build([[1, 2, 3], list(range(20)), [4]], tables, BLOCK_SIZE), cache)
    batch = DecodeBatch.build([5, 6, 7], [3, 20, 1], tables, BLOCK_SIZE)
    model.decode(batch, cache)  # warm: first calls may allocate or pick kernels
    calls_before = attention_kernels.num_calls + fused.num_calls
    with _OpCounter() as counter:
        model.decode(batch, cache)
    mojo_calls = attention_kernels.num_calls + fused.num_calls - calls_before
    return sum(counter.ops.values()) + mojo_calls, counter.ops


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("launch_count")
    return {n: write_random_checkpoint(root / str(n), _config(n)) for n in (2, 3)}


def _per_layer(checkpoints: dict[int, Path], kind: str) -> tuple[int, Counter[str]]:
    two, two_ops = _kernels_per_step(checkpoints[2], kind)
    three, three_ops = _kernels_per_step(checkpoints[3], kind)
    three_ops.subtract(two_ops)
    return three - two, +three_ops


def test_mojo_decode_step_launches_at_most_14_kernels_per_layer(
    checkpoints: dict[int, Path],
) -> None:
    count, torch_ops = _per_layer(checkpoints, "mojo")
    # 4 GEMMs (qkv, o, gate_up, down) + 5 Mojo kernels (2 add+norm, qk-norm+rope+kv, attention,
    # silu*mul): nothing else may run per layer.
    assert count <= MAX_KERNELS_PER_LAYER, (count, torch_ops)
    assert count == 9, (count, torch_ops)


def test_torch_reference_launches_many_more(checkpoints: dict[int, Path]) -> None:
    # The count sees the unfused work: the torch reference is far above the bound.
    count, torch_ops = _per_layer(checkpoints, "torch")
    assert count > 2 * MAX_KERNELS_PER_LAYER, (count, torch_ops)
