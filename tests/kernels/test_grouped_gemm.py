"""The CPU grouped GEMM of a MoE layer (kernels/mojo/experts_cpu.mojo through
kernels/fused/cpu.py) against torch's grouped GEMM, and the whole experts block with it against
the naive loop.

Tolerances as the fused kernels' (test_fused_parity.py): fp32 within 4e-6 of the output's
magnitude (another summation order); bf16/fp16 within 2e-2 (one rounding of the output).
Grid: rows per expert 0 to 9 (every tail of the 4-row tiles), weight rows not a multiple of the
4-row tile or of a work item's 32, K with a tail shorter than a SIMD vector, experts without
rows first, in the middle and last; inline and on three workers.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fused import cpu as fused_cpu
from kernels.fused.cpu import CpuFusedKernels
from mili.engine.model.fused_ops import TorchFusedOps
from mili.engine.model.grouped_gemm import grouped_gemm
from mili.engine.model.moe import grouped_experts, reference_experts, route
from tests.kernels.test_fused_parity import DTYPES, assert_close


def _problem(
    counts: list[int], n: int, k: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(sum(counts), k, generator=g).to(dtype)
    weight = (torch.randn(len(counts), n, k, generator=g) * k**-0.5).to(dtype)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    return rows, weight, offsets


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k"), [(64, 128), (37, 40), (5, 264)])
@pytest.mark.parametrize(
    "counts",
    [[1], [0, 3, 0, 9], [2, 5, 6, 7, 8], [4, 0, 1, 0], [0, 0, 0]],
    ids=["one row", "empty first and last", "every tail", "empty middle", "no rows"],
)
def test_equals_torch(
    fused_kernels: CpuFusedKernels, counts: list[int], n: int, k: int, dtype: torch.dtype
) -> None:
    rows, weight, offsets = _problem(counts, n, k, dtype, seed=n + k)
    expected = grouped_gemm(rows.float(), weight.float(), offsets, "loop").to(dtype)
    calls = fused_kernels.num_calls
    got = fused_kernels.grouped_gemm_kernel(rows, weight, offsets)
    if sum(counts):
        assert_close(got, expected)
    assert got.shape == (sum(counts), n) and got.dtype == dtype
    assert fused_kernels.num_calls == calls + (sum(counts) > 0)


def test_the_kernel_runs_where_it_was_measured_faster(
    cpu_fused_kernels: CpuFusedKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows per active expert in GROUPED_GEMM_ROWS and calls of GROUPED_GEMM_MIN_BYTES of
    weights or more: the kernel; anything else: torch's grouped_mm. Both give the same rows."""
    low, high = fused_cpu.GROUPED_GEMM_ROWS[torch.float32]
    n, k = 16, 32  # two active experts: 2 x 16 x 32 x 4 bytes of weights
    cases = [(low, 4096, 1), (high, 4096, 1), (low - 1, 0, 0), (high + 1, 0, 0), (low, 4097, 0)]
    for rows_per_expert, min_bytes, kernel_calls in cases:
        monkeypatch.setattr(fused_cpu, "GROUPED_GEMM_MIN_BYTES", min_bytes)
        counts = [rows_per_expert, 0, rows_per_expert]
        rows, weight, offsets = _problem(counts, n, k, torch.float32, seed=rows_per_expert)
        before = cpu_fused_kernels.num_calls
        got = cpu_fused_kernels.grouped_gemm(rows, weight, offsets)
        assert cpu_fused_kernels.num_calls - before == kernel_calls, (rows_per_expert, min_bytes)
        assert_close(got, grouped_gemm(rows, weight, offsets, "loop"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r, w, o: (r, w, o.flip(0)), "offsets must rise"),
        (lambda r, w, o: (r, w, o - 1), "offsets must rise"),
        (lambda r, w, o: (r[1:], w, o), "offsets must rise"),
        (lambda r, w, o: (r, w, o.long()), "offsets has dtype"),
        (lambda r, w, o: (r, w[:2], o), "offsets has 3 entries for 2 experts"),
        (lambda r, w, o: (r, w[:, :, 1:].contiguous(), o), "weight rows have 31 entries"),
        (lambda r, w, o: (r, w.double(), o), "weight has dtype"),
        (lambda r, w, o: (r.t(), w, o), "rows must be contiguous"),
    ],
)
def test_bad_arguments_are_refused_before_the_kernel(
    cpu_fused_kernels: CpuFusedKernels, change: object, message: str
) -> None:
    rows, weight, offsets = _problem([2, 1, 3], 8, 32, torch.float32, seed=2)
    rows, weight, offsets = change(rows, weight, offsets)  # type: ignore[operator]
    calls = cpu_fused_kernels.num_calls
    with pytest.raises(ValueError, match=message):
        cpu_fused_kernels.grouped_gemm_kernel(rows, weight, offsets)
    assert cpu_fused_kernels.num_calls == calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 8), (64, 8), (200, 2)])
def test_experts_block_with_the_kernel_equals_the_naive_loop(
    cpu_fused_kernels: CpuFusedKernels,
    monkeypatch: pytest.MonkeyPatch,
    num_tokens: int,
    top_k: int,
    dtype: torch.dtype,
) -> None:
    """The block as the engine runs it on CPU (Mojo ops) = as it runs on the torch ops (which
    test_moe.py holds to the naive loop); 200 tokens x top-2 over 16 experts (~25 rows each) take
    torch's path in bf16, the kernel's in fp32 (these weights are small: no minimum of bytes)."""
    num_experts, hidden, inter = 16, 64, 48
    g = torch.Generator().manual_seed(num_tokens)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=g) * 0.1).to(dtype)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=g).to(dtype)
    routing = route(logits, top_k, norm_topk_prob=True)
    monkeypatch.setattr(fused_cpu, "GROUPED_GEMM_MIN_BYTES", 0)
    got = grouped_experts(x, gate_up, down, routing, cpu_fused_kernels)
    assert_close(got, grouped_experts(x, gate_up, down, routing, TorchFusedOps()))
    if dtype == torch.float32:
        assert_close(got, reference_experts(x, gate_up, down, routing))
