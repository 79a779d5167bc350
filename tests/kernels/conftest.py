"""The CPU kernels, built once per test session into the normal cache (as `make test` prebuilds)."""

from __future__ import annotations

import pytest

from kernels.build import build_cpu
from kernels.cpu import CpuKernels


@pytest.fixture(scope="session")
def cpu_kernels() -> CpuKernels:
    return CpuKernels.from_path(build_cpu(), num_threads=2)
