"""`--require-kernels`: the GPU tests fail, naming what is missing, instead of skipping.

The GPU check (benchmarks/gpu_check.sh) passes it, so stale or missing PTX on the GPU host shows
as failures rather than a quiet row of skips. Run here where the kernels are missing for sure: a
machine without a CUDA GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# One test on each GPU fixture: attention (gpu_kernels, through the parity grid's device
# fixture) and the fused ops (gpu_fused).
GPU_TESTS = [
    "tests/kernels/test_parity.py::test_prefill_fresh_prompt[cuda-1-1-64-16-torch.float32]",
    "tests/kernels/test_fused_gpu.py::test_gpu_silu_mul[1-96-torch.float32]",
]

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="needs a machine without a CUDA GPU: kernels missing"
)


def run_pytest(*extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-q", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [*command, *GPU_TESTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )


def test_gpu_tests_skip_by_default() -> None:
    result = run_pytest()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 skipped" in result.stdout, result.stdout
    assert "needs a CUDA GPU" in result.stdout


def test_gpu_tests_fail_when_the_kernels_are_required() -> None:
    result = run_pytest("--require-kernels")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 errors" in result.stdout, result.stdout  # a fixture failing: errors at setup
    assert "needs a CUDA GPU (--require-kernels: the kernels must be here)" in result.stdout
