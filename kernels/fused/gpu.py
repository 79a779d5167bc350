"""GpuFusedKernels: the fused ops (mili/engine/model/fused_ops.py) on the sm_90 PTX of
kernels/mojo/fused_gpu.mojo, launched on torch's current stream (kernels/fused/ptx.py builds it).

The driver binding (cuda-python, kernels/cuda_driver.py) is the attention kernels'. Nothing here
reads a device tensor back: index ranges are not checked (`check_values=False`), outputs come from
torch's caching allocator on the current stream, so a CUDA graph can capture a step.
"""

from __future__ import annotations

import ctypes
import math
import threading
from pathlib import Path
from typing import Any

import torch

from kernels.cuda_driver import _MAX_GRID_X, _MAX_GRID_YZ, _make_driver, pack_arguments
from kernels.fused.checks import check_norm, check_qk_norm_rope, check_silu_mul
from kernels.fused.ptx import (
    GEMV_MAX_TOKENS,
    GEMV_NORM_MAX_FEATURES,
    GEMV_WARPS,
    MANIFEST_FORMAT,
    NORM_THREADS,
    ROPE_THREADS,
    SIGNATURES,
    SILU_THREADS,
)
from kernels.gpu import _DTYPE_NAMES
from kernels.manifest import load_manifest
from kernels.ptx_entry import check_signature, parse_entries
from mili.engine.model.fused_ops import FusedOps
from mili.engine.model.grouped_gemm import grouped_gemm


def pack(kernel: str, values: dict[str, int | float]) -> list[ctypes._SimpleCData]:
    """Launch arguments in the entry's parameter order (kernels.fused.ptx.SIGNATURES)."""
    return pack_arguments(SIGNATURES, kernel, values)


class GpuFusedKernels(FusedOps):
    """`FusedOps` on CUDA tensors (fp32, bf16, fp16; head_dim 64, 128, 256)."""

    name = "mojo"
    is_graph_safe = True  # no host sync, allocations from torch's allocator on its stream

    def __init__(self, kernel_dir: str | Path) -> None:
        self.kernel_dir = Path(kernel_dir)
        self._manifest: dict | None = None
        self._driver: Any = None
        self._functions: dict[tuple[int, str, str, int], Any] = {}
        self._lock = threading.Lock()
        # Launch each kernel overlapping the previous one's tail (kernels/cuda_driver.py): off
        # until a GPU run measures it (benchmarks/engine_gpu.py --overlap-launches).
        self.overlap_launches = False
        # False once a gemv failed the start-up self-check (`fall_back`): torch's GEMM then.
        self.gemv = True
        self.num_calls = 0  # launches, for launch-count tests and benchmarks

    @property
    def manifest(self) -> dict:
        if self._manifest is None:
            self._manifest = load_manifest(self.kernel_dir, MANIFEST_FORMAT)
        return self._manifest

    def _function(self, device: int, kernel: str, dtype: str, head_dim: int) -> Any:
        key = (device, kernel, dtype, head_dim)
        func = self._functions.get(key)
        if func is not None:
            return func
        with self._lock:
            if key not in self._functions:
                records = [
                    r
                    for r in self.manifest["kernels"]
                    if (r["kernel"], r["dtype"], r["head_dim"]) == (kernel, dtype, head_dim)
                ]
                if len(records) != 1:
                    raise RuntimeError(
                        f"{self.kernel_dir}/manifest.json has no {kernel} {dtype} D={head_dim}"
                    )
                rec = records[0]
                text = (self.kernel_dir / rec["file"]).read_text()
                entries = parse_entries(text)
                if rec["entry"] not in entries:
                    raise RuntimeError(f"{rec['file']} has no entry {rec['entry']}; rebuild it")
                check_signature(SIGNATURES, kernel, entries[rec["entry"]])
                if self._driver is None:
                    self._driver = _make_driver()
                # Static shared memory only: no dynamic shared-memory limit to raise.
                self._functions[key] = self._driver.load(device, text, rec["entry"], 0)
        return self._functions[key]

    def _launch(
        self,
        like: torch.Tensor,
        kernel: str,
        head_dim: int,
        grid: tuple[int, int, int],
        threads: int,
        values: dict[str, int | float],
    ) -> None:
        if not (0 < grid[0] <= _MAX_GRID_X and 0 < grid[1] <= _MAX_GRID_YZ and grid[2] == 1):
            raise ValueError(f"{kernel}: grid {grid} out of the CUDA limits")
        device = like.device.index if like.device.index is not None else torch.cuda.current_device()
        args = pack(kernel, values)
        with torch.cuda.device(device):
            func = self._function(device, kernel, _DTYPE_NAMES[like.dtype], head_dim)
            stream = torch.cuda.current_stream(device).cuda_stream
            self.num_calls += 1
            self._driver.launch(
                device, func, grid, (threads, 1, 1), stream, args, 0, self.overlap_launches
            )

    def fall_back(self, kernel: str) -> bool:
        """Do without the self-check's `kernel` (kernels/choice.py), if only it failed:
        a gemv kernel's (fused.linear, fused.silu_mul_linear, fused.add_rms_norm_linear) -> every
        projection on the separate ops and torch's GEMM. False for any other kernel."""
        if kernel not in ("fused.linear", "fused.silu_mul_linear", "fused.add_rms_norm_linear"):
            return False
        self.gemv = False
        return True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _require_cuda(x)
        out = torch.empty_like(x)
        self._norm(out, x, None, weight, eps)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        _require_cuda(x)
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
        check_norm(x, residual, weight)
        rows, dim = x.shape
        if rows == 0:
            return
        self._launch(
            x,
            "add_rms_norm",
            0,
            (rows, 1, 1),
            NORM_THREADS,
            {
                "out": out.data_ptr(),
                "x": x.data_ptr(),
                "residual": x.data_ptr() if residual is None else residual.data_ptr(),
                "weight": weight.data_ptr(),
                "dim": dim,
                "has_residual": int(residual is not None),
                "eps": eps,
            },
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
        _require_cuda(qkv)
        dims = check_qk_norm_rope(
            qkv,
            q_weight,
            k_weight,
            cos_sin,
            positions,
            slot_mapping,
            k_cache,
            v_cache,
            check_values=False,
        )
        tokens, heads, kv_heads, head_dim = (
            dims.num_tokens,
            dims.num_q_heads,
            dims.num_kv_heads,
            dims.head_dim,
        )
        q = torch.empty((tokens, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        if tokens:
            self._launch(
                qkv,
                "qk_norm_rope",
                head_dim,
                (tokens, math.ceil((heads + 2 * kv_heads) / (ROPE_THREADS // 32)), 1),
                ROPE_THREADS,
                {
                    "q_out": q.data_ptr(),
                    "qkv": qkv.data_ptr(),
                    "q_weight": q_weight.data_ptr(),
                    "k_weight": k_weight.data_ptr(),
                    "cos_sin": cos_sin.data_ptr(),
                    "positions": positions.data_ptr(),
                    "slot_mapping": slot_mapping.data_ptr(),
                    "k_cache": k_cache.data_ptr(),
                    "v_cache": v_cache.data_ptr(),
                    "num_q_heads": heads,
                    "num_kv_heads": kv_heads,
                    "eps": eps,
                },
            )
        _, k, v = qkv.view(tokens, heads + 2 * kv_heads, head_dim).split(
            (heads, kv_heads, kv_heads), dim=1
        )
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        _require_cuda(gate_up)
        check_silu_mul(gate_up)
        rows, width = gate_up.shape
        inter = width // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
        if rows and inter:
            self._launch(
                gate_up,
                "silu_mul",
                0,
                (rows, math.ceil(inter / SILU_THREADS), 1),
                SILU_THREADS,
                {"out": out.data_ptr(), "gate_up": gate_up.data_ptr(), "intermediate": inter},
            )
        return out

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [T, K] @ weight [N, K].T: the gemv kernel for T <= GEMV_MAX_TOKENS rows of bf16 or
        fp16 without a bias (decode's steps; 16-byte aligned rows), torch's GEMM otherwise."""
        _require_cuda(x)
        if not (self.gemv and _takes_gemv(x, weight, bias)):
            return super().linear(x, weight, bias)
        tokens, in_features = x.shape
        out_features = weight.shape[0]
        out = torch.empty((tokens, out_features), dtype=x.dtype, device=x.device)
        if tokens and out_features:
            self._launch(
                x,
                "gemv",
                0,
                (math.ceil(out_features / GEMV_WARPS), 1, 1),
                32 * GEMV_WARPS,
                {
                    "out": out.data_ptr(),
                    "x": x.data_ptr(),
                    "weight": weight.data_ptr(),
                    "tokens": tokens,
                    "out_features": out_features,
                    "in_features": in_features,
                },
            )
        return out

    def silu_mul_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The down projection of silu(gate) * up: one gemv_silu launch where the gemv takes
        the shapes (the product is made as the gemv reads it), else silu_mul then linear."""
        _require_cuda(gate_up)
        fused = self.gemv and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0
        if not fused or not _takes_gemv(gate_up.chunk(2, dim=1)[0], weight, None, gate_up):
            return super().silu_mul_linear(gate_up, weight)
        rows, width = gate_up.shape
        out_features = weight.shape[0]
        out = torch.empty((rows, out_features), dtype=gate_up.dtype, device=gate_up.device)
        if out_features:
            self._launch(
                gate_up,
                "gemv_silu",
                0,
                (math.ceil(out_features / GEMV_WARPS), 1, 1),
                32 * GEMV_WARPS,
                {
                    "out": out.data_ptr(),
                    "gate_up": gate_up.data_ptr(),
                    "weight": weight.data_ptr(),
                    "tokens": rows,
                    "out_features": out_features,
                    "in_features": width // 2,
                },
            )
        return out

    def add_rms_norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One gemv_norm launch where the gemv takes the shapes (each CTA norms the rows
        itself; the new residual is a new tensor, CTA 0's), else the norm then `linear`."""
        _require_cuda(x)
        fused = (
            self.gemv
            and _takes_gemv(x, weight, bias)
            and x.shape[1] <= GEMV_NORM_MAX_FEATURES
            and norm_weight.shape == (x.shape[1],)
            and norm_weight.dtype == x.dtype
            and norm_weight.is_contiguous()
            and norm_weight.data_ptr() % 16 == 0
            and (residual is None or _same_layout(residual, x))
        )
        if not fused:
            return super().add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)
        tokens, in_features = x.shape
        out_features = weight.shape[0]
        out = torch.empty((tokens, out_features), dtype=x.dtype, device=x.device)
        residual_out = x if residual is None else torch.empty_like(x)
        self._launch(
            x,
            "gemv_norm",
            0,
            (math.ceil(out_features / GEMV_WARPS), 1, 1),
            32 * GEMV_WARPS,
            {
                "out": out.data_ptr(),
                "x": x.data_ptr(),
                # without a residual r is x, and nothing is written to residual_out
                "residual": x.data_ptr() if residual is None else residual.data_ptr(),
                "residual_out": residual_out.data_ptr(),
                "norm_weight": norm_weight.data_ptr(),
                "weight": weight.data_ptr(),
                "tokens": tokens,
                "out_features": out_features,
                "in_features": in_features,
                "has_residual": int(residual is not None),
                "eps": eps,
            },
        )
        return out, residual_out

    def grouped_gemm(
        self, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        # torch's (CUTLASS's grouped GEMM on Hopper): no Mojo kernel of ours has been measured
        # against it on a GPU.
        return grouped_gemm(rows, weight, offsets)


def _takes_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: torch.Tensor | None = None,
) -> bool:
    """Whether the gemv kernel computes F.linear(x, weight, bias): 1..GEMV_MAX_TOKENS rows,
    bf16/fp16 on one device, rows of whole 16-byte vectors, 16-byte aligned. `rows`: the
    tensor whose rows x's are a part of (gemv_silu's gate_up; x its gate half), contiguous;
    else x itself must be."""
    whole = x if rows is None else rows
    return (
        bias is None
        and x.dim() == 2
        and weight.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.device == x.device
        and 0 < x.shape[0] <= GEMV_MAX_TOKENS
        and x.shape[1] == weight.shape[1]
        and x.shape[1] % (16 // x.element_size()) == 0
        and whole.is_contiguous()
        and weight.is_contiguous()
        and whole.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
    )


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a has b's shape, dtype and device, contiguous and 16-byte aligned."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device
        and a.is_contiguous()
        and a.data_ptr() % 16 == 0
    )


def _require_cuda(t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_cuda:
        where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"GpuFusedKernels needs CUDA tensors, got one on {where}")
