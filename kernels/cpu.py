"""The CPU binding of the Mojo attention kernels: validate in Python, then hand over pointers.

`mili_attention.prefill/decode` (kernels/mojo/mili_attention.mojo) take raw data pointers, so
every assumption they make — dtype, device, contiguity, shapes, index ranges — is checked first by
kernels/checks.py. They parallelise over the Mojo runtime's workers; we pass torch's thread count
so the two pools never ask for more cores than torch was given.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Self

import numpy as np
import torch

from kernels.build import CPU_MODULE
from kernels.checks import check_decode, check_prefill

# Mojo's runtime, when the module initialises, setenv()s these for its own Python interop, below
# os.environ's notice. Children would inherit them: PYTHONEXECUTABLE (the interpreter Mojo found
# first, e.g. a pyenv shim) moves a child's sys.executable out of our venv, so a service started
# from this process, or the `mojo` compiler's own Python entry point, can no longer import its
# packages. We put the process environment back as it was.
_RUNTIME_ENV = ("PYTHONPATH", "PYTHONEXECUTABLE", "PYTHONHOME", "MOJO_PYTHON_LIBRARY")


def load_module(path: Path) -> ModuleType:
    """Import the compiled extension module at `path` (its PyInit name is `mili_attention`)."""
    loader = importlib.machinery.ExtensionFileLoader(CPU_MODULE, str(path))
    spec = importlib.util.spec_from_file_location(CPU_MODULE, str(path), loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    finally:
        _restore_environment()
    return module


def _restore_environment() -> None:
    for name in _RUNTIME_ENV:
        if name in os.environ:
            os.putenv(name, os.environ[name])
        else:
            os.unsetenv(name)


# Below these, a call runs on one Mojo worker: the measured crossovers where two workers start
# to win (docs/benchmarks.md, "Measurements behind choices in the code").
DECODE_ONE_THREAD_BYTES = 2 * 2**20
PREFILL_ONE_THREAD_FLOPS = 10e6


class CpuModuleBinding:
    """The loaded CPU extension module and its threading options: what the attention and the
    fused-op bindings share."""

    def __init__(
        self, module: ModuleType, num_threads: int | None = None, *, always_parallel: bool = False
    ) -> None:
        self._module = module
        self._num_threads = num_threads  # None: torch.get_num_threads() at each call
        self._always_parallel = always_parallel  # tests: every call on all workers
        # Kernel calls made, for launch-count tests (torch's profiler does not see them).
        self.num_calls = 0

    @classmethod
    def from_path(cls, path: Path, num_threads: int | None = None) -> Self:
        return cls(load_module(path), num_threads)

    def with_options(self, *, num_threads: int | None, always_parallel: bool) -> Self:
        """The same module with other threading options."""
        return type(self)(self._module, num_threads, always_parallel=always_parallel)


class CpuKernels(CpuModuleBinding):
    """An AttentionBackend (mili.engine.model.attention) on CPU tensors."""

    name = "mojo"
    is_graph_safe = False  # CPU tensors: there is no CUDA graph to capture

    def _threads(self, work: float, one_thread_below: float) -> int:
        """Workers for a call of `work` units: one below the threshold, else all we were given.

        Waking Mojo's workers costs more than small calls take (docs/benchmarks.md,
        "Measurements behind choices in the code"), and the woken workers spin a while
        afterwards beside torch's threads. One thread means the caller's: the kernels run
        inline, no runtime worker involved.
        """
        threads = max(1, self._num_threads or torch.get_num_threads())
        return 1 if work < one_thread_below and not self._always_parallel else threads

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        start_positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, H, D] -> out [T, H, D]; keys/values (prefix and new tokens) from the cache,
        so `k`/`v` go unused."""
        _require_cpu(q)
        dims = check_prefill(
            q, k_cache, v_cache, cu_seqlens, start_positions, block_tables, scale=scale
        )
        out = torch.empty_like(q)
        if dims.num_tokens == 0:
            return out
        ptrs = (
            out.data_ptr(),
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            cu_seqlens.data_ptr(),
            start_positions.data_ptr(),
            block_tables.data_ptr(),
        )
        # Causal score pairs: sequence i's n new tokens each attend start + j + 1 positions.
        lengths = np.diff(cu_seqlens.numpy()).astype(np.float64)
        pairs = float((lengths * (start_positions.numpy() + (lengths + 1) / 2)).sum())
        flops = 4 * dims.num_q_heads * dims.head_dim * pairs
        threads = self._threads(flops, PREFILL_ONE_THREAD_FLOPS)
        self.num_calls += 1
        self._module.prefill(ptrs, (*dims, threads), float(scale))
        return out

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        scale: float,
        num_splits: int = 0,
    ) -> torch.Tensor:
        """q: [B, H, D] -> out [B, H, D]; `num_splits` 0 lets the kernel split long contexts."""
        _require_cpu(q)
        dims = check_decode(
            q, k_cache, v_cache, block_tables, seq_lens, scale=scale, num_splits=num_splits
        )
        out = torch.empty_like(q)
        if dims.num_seqs == 0:
            return out
        ptrs = (
            out.data_ptr(),
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
        )
        contexts = float(seq_lens.numpy().sum(dtype=np.int64))
        kv_bytes = 2 * contexts * dims.num_kv_heads * dims.head_dim * q.element_size()
        threads = self._threads(kv_bytes, DECODE_ONE_THREAD_BYTES)
        self.num_calls += 1
        self._module.decode(ptrs, (*dims, threads, num_splits), float(scale))
        return out


def _require_cpu(q: torch.Tensor) -> None:
    if not isinstance(q, torch.Tensor) or q.device.type != "cpu":
        where = q.device if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"the CPU kernels need CPU tensors, q is on {where}")
