"""`select_fused_ops`: the FusedOps a service runs, chosen like its attention backend.

    torch   mili.engine.fused_ops.TorchFusedOps, the reference
    mojo    the Mojo kernels of the device (kernels/fused/cpu.py, kernels/fused/gpu.py); a
            missing or failing toolchain (or missing PTX on a GPU host) stops the service
    auto    Mojo where the kernels build for the device and the model's head_dim, else torch

Services pass their `--attention` choice: one flag picks the kernel family of a process, so
`--attention torch` runs the model on torch alone (the reference end to end).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kernels import build
from kernels.checks import HEAD_DIMS
from kernels.fused.cpu import CpuFusedKernels
from mili.engine.engine_config import ATTENTION_CHOICES
from mili.engine.model.fused_ops import FusedOps, TorchFusedOps

_LOG = logging.getLogger("mili.kernels")


def load_mojo_fused_ops(device: torch.device | str, root: Path | None = None) -> FusedOps:
    """Build (or find in the cache) the fused kernels for `device`; KernelBuildError if not."""
    device = torch.device(device)
    if device.type == "cpu":
        return CpuFusedKernels.from_path(build.build_cpu(root))
    if device.type == "cuda":
        from kernels.fused.gpu import GpuFusedKernels
        from kernels.fused.ptx import build_fused_gpu, fused_kernel_dir

        # GPU hosts usually lack the toolchain: PTX is built where Mojo is and carried over.
        ptx_dir = build.find_ptx(fused_kernel_dir(root), "fused-op")
        if not (ptx_dir / "manifest.json").exists():
            ptx_dir = build_fused_gpu(root)
        return GpuFusedKernels(ptx_dir)
    raise build.KernelBuildError(f"no Mojo fused kernels for device type {device.type!r}")


def select_fused_ops(
    choice: str, device: torch.device | str, *, head_dim: int, root: Path | None = None
) -> FusedOps:
    """The FusedOps `choice` (auto, mojo, torch) means for a model with `head_dim` on `device`.

    `auto` logs why it falls back to torch; `mojo` raises KernelBuildError instead.
    """
    if choice not in ATTENTION_CHOICES:
        raise ValueError(
            f"kernel choice must be one of {', '.join(ATTENTION_CHOICES)}, got {choice}"
        )
    if choice == "torch":
        return TorchFusedOps()
    try:
        if head_dim not in HEAD_DIMS:
            raise build.KernelBuildError(
                f"the Mojo fused kernels support head_dim {', '.join(map(str, HEAD_DIMS))}; "
                f"this model has {head_dim}"
            )
        ops = load_mojo_fused_ops(device, root)
    except build.KernelBuildError as exc:
        if choice == "mojo":
            raise
        _LOG.warning("Mojo fused kernels unavailable, using the torch reference ops: %s", exc)
        return TorchFusedOps()
    return ops
