"""A MoE layer's grouped GEMM in torch: rows sorted by expert, each slice times its expert.

    x        [R, K]     rows sorted by expert (mili/engine/model/moe.py sorts them)
    weight   [E, N, K]  expert e's [N, K] matrix (HF's stacked gate_up_proj / down_proj)
    offsets  [E]        int32, on x's device: expert e's rows end at offsets[e] (start at
                        offsets[e - 1], 0 for e = 0); an expert with no rows has an empty slice
    out      [R, N]     out[r] = x[r] @ weight[expert of r].T

Two ways in torch, the same arithmetic (`GroupedGemm`):

- "grouped_mm": `torch._grouped_mm(x, weight.mT, offs=offsets)`, one call with the offsets left
  on the device. Every shape is static (R rows whatever the routing) and nothing reads a device
  value on the host, so a decode step with it is graph-capturable and `torch.compile`-safe. On
  CUDA torch runs it as one CUTLASS grouped GEMM for bf16 on sm_90 and sm_100 (dimensions
  multiples of 8); elsewhere on CUDA its fallback copies the offsets to the host, so there we
  take "loop" and decode runs eagerly (`is_graph_safe`). On CPU torch loops over the groups in
  C++; it measured as fast as or faster than "loop" (benchmarks/moe.py, docs/benchmarks.md).
  On every device it needs rows of whole 16-byte units (K and N times the element size): a
  model whose hidden or expert width is not (every published Qwen3-MoE's is) takes "loop".
- "loop": one GEMM per expert that got rows, over its contiguous slice; the slice bounds come to
  the host (one sync per call). The fallback where grouped_mm has no graph-safe kernel.

These are `TorchFusedOps.grouped_gemm`; the CPU's Mojo ops run their own kernel where it is
faster (kernels/fused/cpu.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

GroupedGemm = Literal["loop", "grouped_mm"]


def default_grouped_gemm(
    device: torch.device, dtype: torch.dtype, widths: Sequence[int]
) -> GroupedGemm:
    """What runs on `device` in `dtype` for GEMMs whose K and N are among `widths` (a MoE
    layer's: hidden_size and moe_intermediate_size; module docstring): grouped_mm where torch
    has it without a host sync (CPU; CUDA bf16 on sm_90/sm_100) and the rows are whole 16-byte
    units, else the per-expert loop."""
    if any(width * dtype.itemsize % 16 for width in widths):
        return "loop"
    if device.type != "cuda":
        return "grouped_mm"
    major, _ = torch.cuda.get_device_capability(device)
    return "grouped_mm" if dtype == torch.bfloat16 and major in (9, 10) else "loop"


def is_graph_safe(device: torch.device, dtype: torch.dtype, widths: Sequence[int]) -> bool:
    """Whether MoE layers on `device` in `dtype` (of `widths`) may be captured in a CUDA
    graph."""
    return default_grouped_gemm(device, dtype, widths) == "grouped_mm"


def grouped_gemm(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, how: GroupedGemm | None = None
) -> torch.Tensor:
    """x [R, K], weight [E, N, K], offsets [E] -> [R, N] (module docstring); `how` None: the
    default for x's device and dtype."""
    how = how or default_grouped_gemm(x.device, x.dtype, (x.shape[1], weight.shape[1]))
    if how == "grouped_mm":
        return torch._grouped_mm(x, weight.mT, offs=offsets)
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):  # the host sync that keeps this off CUDA graphs
        if end > start:
            torch.mm(x[start:end], weight[e].t(), out=out[start:end])
        start = end
    return out
