"""The CPU binding of the fused kernels (kernels/mojo/fused_cpu.mojo): a `FusedOps`.

The kernels live in the `mili_attention` extension module beside the attention kernels (one
build, one load). Arguments are validated by kernels/fused/checks.py before pointers cross.
`num_calls` counts kernel calls, for launch-count tests and benchmarks (torch's profiler does
not see them).
"""

from __future__ import annotations

import torch

from kernels.cpu import CpuModuleBinding
from kernels.fused.checks import (
    check_grouped_gemm,
    check_norm,
    check_qk_norm_rope,
    check_silu_mul,
)
from mili.engine.model.fused_ops import FusedOps
from mili.engine.model.grouped_gemm import grouped_gemm

# Below this many bytes read and written, a call runs inline on the caller's thread: waking the
# Mojo runtime's workers costs more than the pass (a decode step's rows are a few KiB).
ONE_THREAD_BYTES = 1 << 20
# Where the Mojo grouped GEMM beats torch's grouped_mm (docs/benchmarks.md, "Measurements behind
# choices in the code"): with rows per active expert in [low, high] (it streams each expert's
# weights once per 4 of its rows: above `high` oneDNN's packed GEMMs, AMX in bf16, win; below
# `low` MKL's fp32 GEMV streams as fast), and on calls that read at least GROUPED_GEMM_MIN_BYTES
# of weights: on shorter ones its two workers share the cores with torch's OpenMP threads, still
# spinning after the op before, and lose.
GROUPED_GEMM_ROWS = {torch.float32: (3, 32), torch.bfloat16: (1, 6), torch.float16: (1, 16)}
GROUPED_GEMM_MIN_BYTES = 192 << 20


class CpuFusedKernels(CpuModuleBinding, FusedOps):
    """`FusedOps` on CPU tensors (fp32, bf16, fp16; head_dim 64, 128, 256)."""

    name = "mojo"
    is_graph_safe = False  # CPU tensors: there is no CUDA graph to capture

    def _threads(self, num_bytes: int, rows: int) -> int:
        if num_bytes < ONE_THREAD_BYTES and not self._always_parallel:
            return 1
        return max(1, min(rows, self._num_threads or torch.get_num_threads()))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _require_cpu(x)
        out = torch.empty_like(x)
        self._norm(out, x, None, weight, eps)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        _require_cpu(x)
        self._norm(x, x, residual, weight, eps)  # the result over x, as FusedOps allows
        return x

    def _norm(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> None:
        code = check_norm(x, residual, weight)
        rows, dim = x.shape
        if rows == 0:
            return
        ptrs = (
            out.data_ptr(),
            x.data_ptr(),
            0 if residual is None else residual.data_ptr(),
            weight.data_ptr(),
        )
        passes = 3 if residual is None else 5  # tensors of x's size read or written
        threads = self._threads(passes * x.numel() * x.element_size(), rows)
        self.num_calls += 1
        self._module.add_rms_norm(
            ptrs, (code, rows, dim, int(residual is not None), threads), float(eps)
        )

    def qk_norm_rope_kv(
        self,
        qkv: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        cos_sin: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _require_cpu(qkv)
        dims = check_qk_norm_rope(
            qkv, q_weight, k_weight, cos_sin, positions, slot_mapping, k_cache, v_cache
        )
        num_tokens, heads, kv_heads, head_dim = (
            dims.num_tokens,
            dims.num_q_heads,
            dims.num_kv_heads,
            dims.head_dim,
        )
        q = torch.empty((num_tokens, heads, head_dim), dtype=qkv.dtype)
        if num_tokens:
            ptrs = (
                q.data_ptr(),
                qkv.data_ptr(),
                q_weight.data_ptr(),
                k_weight.data_ptr(),
                cos_sin.data_ptr(),
                positions.data_ptr(),
                slot_mapping.data_ptr(),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
            )
            threads = self._threads(2 * qkv.numel() * qkv.element_size(), num_tokens)
            self.num_calls += 1
            self._module.qk_norm_rope(
                ptrs,
                (dims.dtype_code, num_tokens, heads, kv_heads, head_dim, threads),
                float(eps),
            )
        _, k, v = qkv.view(num_tokens, heads + 2 * kv_heads, head_dim).split(
            (heads, kv_heads, kv_heads), dim=1
        )
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        _require_cpu(gate_up)
        code = check_silu_mul(gate_up)
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        if rows:
            threads = self._threads(3 * out.numel() * out.element_size(), rows)
            self.num_calls += 1
            self._module.silu_mul(
                (out.data_ptr(), gate_up.data_ptr()), (code, rows, width // 2, threads)
            )
        return out

    def grouped_gemm(
        self, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """The Mojo kernel where it was measured faster (GROUPED_GEMM_ROWS, _MIN_BYTES), else
        torch's grouped_mm."""
        _require_cpu(rows)
        expert_bytes = weight[0].numel() * weight.element_size() if len(weight) else 0
        if min(rows.shape[0], len(weight)) * expert_bytes < GROUPED_GEMM_MIN_BYTES:
            return grouped_gemm(rows, weight, offsets)  # too few experts can have rows
        code, active = check_grouped_gemm(rows, weight, offsets)
        low, high = GROUPED_GEMM_ROWS[rows.dtype]
        rows_fit = low * len(active) <= rows.shape[0] <= high * len(active)
        if rows_fit and len(active) * expert_bytes >= GROUPED_GEMM_MIN_BYTES:
            return self._kernel(rows, weight, offsets, code, active)
        return grouped_gemm(rows, weight, offsets)

    def grouped_gemm_kernel(
        self, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """`grouped_gemm` on the Mojo kernel whatever the size (the start-up self-check and
        the tests call it: small calls would go to torch)."""
        _require_cpu(rows)
        code, active = check_grouped_gemm(rows, weight, offsets)
        return self._kernel(rows, weight, offsets, code, active)

    def _kernel(
        self,
        rows: torch.Tensor,
        weight: torch.Tensor,
        offsets: torch.Tensor,
        code: int,
        active: torch.Tensor,
    ) -> torch.Tensor:
        """The kernel on checked arguments (`check_grouped_gemm`'s code and active experts)."""
        num_rows, n = rows.shape[0], weight.shape[1]
        out = torch.empty((num_rows, n), dtype=rows.dtype)
        if num_rows:
            weight_bytes = len(active) * weight[0].numel() * weight.element_size()
            threads = self._threads(weight_bytes, len(active) * n)
            self.num_calls += 1
            ptrs = (
                out.data_ptr(),
                rows.data_ptr(),
                weight.data_ptr(),
                offsets.data_ptr(),
                active.data_ptr(),
            )
            self._module.grouped_gemm(
                ptrs, (code, num_rows, n, rows.shape[1], len(active), threads)
            )
        return out


def _require_cpu(t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"the CPU fused kernels need CPU tensors, got one on {where}")
