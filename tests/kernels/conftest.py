"""The kernels under test: CPU (built once per session into the normal cache, as `make test`
prebuilds it) and, where a CUDA GPU is present, the sm_90 PTX of this source.

Without a GPU or the PTX the GPU tests skip; with `--require-kernels` (the GPU check passes it)
they fail instead, naming what is missing."""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import pytest
import torch

from kernels import build, ptx
from kernels.cpu import CpuKernels
from kernels.fused import ptx as fused_ptx
from kernels.fused.cpu import CpuFusedKernels
from mili.engine.model.fused_ops import FusedOps

if TYPE_CHECKING:
    from kernels.gpu import GpuKernels


def kernels_missing(config: pytest.Config, reason: str) -> NoReturn:
    """Skip the test, or fail it under --require-kernels."""
    if config.getoption("--require-kernels"):
        pytest.fail(f"{reason} (--require-kernels: the kernels must be here)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def cpu_kernels() -> CpuKernels:
    return CpuKernels.from_path(build.build_cpu(), num_threads=2)


@pytest.fixture(scope="session")
def gpu_kernels(pytestconfig: pytest.Config) -> GpuKernels:
    """PTX from the kernel cache: built here with the toolchain, or carried to a GPU host
    (`MILI_CACHE_DIR=<dir> mili kernels build --gpu` where Mojo is, then MILI_CACHE_DIR=<dir>)."""
    if not torch.cuda.is_available():
        kernels_missing(pytestconfig, "needs a CUDA GPU")
    from kernels.gpu import GpuKernels

    kernel_dir = build.gpu_kernel_dir()
    if not (kernel_dir / "manifest.json").exists():
        try:
            kernel_dir = ptx.build_gpu()
        except build.KernelBuildError as exc:
            kernels_missing(
                pytestconfig, f"no PTX at {kernel_dir} and it cannot be built here: {exc}"
            )
    return GpuKernels(kernel_dir)


@pytest.fixture(scope="session")
def gpu_fused(pytestconfig: pytest.Config) -> FusedOps:
    """The fused kernels' PTX, found or built as gpu_kernels' is."""
    if not torch.cuda.is_available():
        kernels_missing(pytestconfig, "needs a CUDA GPU")
    from kernels.fused.gpu import GpuFusedKernels

    kernel_dir = fused_ptx.fused_kernel_dir()
    if not (kernel_dir / "manifest.json").exists():
        try:
            kernel_dir = fused_ptx.build_fused_gpu()
        except build.KernelBuildError as exc:
            kernels_missing(
                pytestconfig, f"no fused PTX at {kernel_dir} and it cannot be built here: {exc}"
            )
    return GpuFusedKernels(kernel_dir)


@pytest.fixture(params=["cpu", "cpu-3-workers", pytest.param("cuda", marks=pytest.mark.gpu)])
def device_kernels(request: pytest.FixtureRequest) -> tuple[str, CpuKernels | GpuKernels]:
    """(device, kernels) for every kernel implementation: the parity grid runs on each.

    "cpu" is what serving runs (small calls on one worker); "cpu-3-workers" forces every call
    onto three workers, so the multi-worker paths (work split across workers, decode's split
    combine) meet every shape too, and with an odd worker count.
    """
    if request.param == "cuda":
        return "cuda", request.getfixturevalue("gpu_kernels")
    kernels: CpuKernels = request.getfixturevalue("cpu_kernels")
    if request.param == "cpu-3-workers":
        kernels = kernels.with_options(num_threads=3, always_parallel=True)
    return "cpu", kernels


@pytest.fixture(scope="session")
def cpu_fused_kernels() -> CpuFusedKernels:
    return CpuFusedKernels.from_path(build.build_cpu(), num_threads=2)


@pytest.fixture(params=["cpu", "cpu-3-workers"])
def fused_kernels(request: pytest.FixtureRequest, cpu_fused_kernels: CpuFusedKernels) -> FusedOps:
    """Every fused-kernel implementation: inline on the caller's thread (what a decode step
    runs) and forced onto three workers (what big prefill chunks run)."""
    if request.param == "cpu-3-workers":
        return cpu_fused_kernels.with_options(num_threads=3, always_parallel=True)
    return cpu_fused_kernels
