"""The `--attention` choice, per kernel family: the torch references or the Mojo kernels.

    --attention torch   the torch references (mili.engine.model.attention.TorchAttention,
                        mili.engine.model.fused_ops.TorchFusedOps)
    --attention mojo    the Mojo kernels of the device; a missing or failing toolchain (or
                        missing PTX on a GPU host) stops the service
    --attention auto    (default) Mojo where the kernels build for the device and the model's
                        head_dim, else torch

One flag picks the kernel family of a process, so `--attention torch` runs the model on torch
alone (the reference end to end). The engine never imports this package: kernels/cpu.py's
CpuKernels and kernels/gpu.py's GpuKernels satisfy the AttentionBackend Protocol structurally,
kernels/fused/'s CpuFusedKernels and GpuFusedKernels the FusedOps one, and services pick them
here once at start-up (kernels/choice.py) and hand them to the model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from kernels import build, ptx
from kernels.cpu import CpuKernels
from kernels.fused.cpu import CpuFusedKernels
from kernels.signatures import HEAD_DIMS
from mili.engine.engine_config import ATTENTION_CHOICES
from mili.engine.model.attention import AttentionBackend, TorchAttention
from mili.engine.model.fused_ops import FusedOps, TorchFusedOps

_LOG = logging.getLogger("mili.kernels")
Kernels = TypeVar("Kernels", AttentionBackend, FusedOps)


def load_mojo_attention(device: torch.device | str, root: Path | None = None) -> AttentionBackend:
    """Build (or find in the cache) the kernels for `device`; KernelBuildError if impossible."""
    device = torch.device(device)
    if device.type == "cpu":
        return CpuKernels.from_path(build.build_cpu(root))
    if device.type == "cuda":
        from kernels.gpu import GpuKernels

        # GPU hosts usually lack the toolchain: PTX is built where Mojo is and carried over.
        ptx_dir = build.find_ptx(build.gpu_kernel_dir(root), "attention")
        if not (ptx_dir / "manifest.json").exists():
            ptx_dir = ptx.build_gpu(root)
        return GpuKernels(ptx_dir)
    raise build.KernelBuildError(f"no Mojo attention kernels for device type {device.type!r}")


def load_mojo_fused_ops(device: torch.device | str, root: Path | None = None) -> FusedOps:
    """Build (or find in the cache) the fused kernels for `device`; KernelBuildError if not."""
    device = torch.device(device)
    if device.type == "cpu":
        return CpuFusedKernels.from_path(build.build_cpu(root))
    if device.type == "cuda":
        from kernels.fused.gpu import GpuFusedKernels
        from kernels.fused.ptx import build_fused_gpu, fused_kernel_dir

        # As the attention kernels' PTX: built where Mojo is, carried to the GPU host.
        ptx_dir = build.find_ptx(fused_kernel_dir(root), "fused-op")
        if not (ptx_dir / "manifest.json").exists():
            ptx_dir = build_fused_gpu(root)
        return GpuFusedKernels(ptx_dir)
    raise build.KernelBuildError(f"no Mojo fused kernels for device type {device.type!r}")


def select_attention(
    choice: str, device: torch.device | str, *, head_dim: int, root: Path | None = None
) -> AttentionBackend:
    """The backend `--attention choice` means for a model with `head_dim` on `device`."""
    return _select(choice, "attention", TorchAttention, load_mojo_attention, device, head_dim, root)


def select_fused_ops(
    choice: str, device: torch.device | str, *, head_dim: int, root: Path | None = None
) -> FusedOps:
    """The FusedOps `--attention choice` means for a model with `head_dim` on `device`."""
    return _select(choice, "fused", TorchFusedOps, load_mojo_fused_ops, device, head_dim, root)


def _select(
    choice: str,
    family: str,
    reference: Callable[[], Kernels],
    load: Callable[[torch.device | str, Path | None], Kernels],
    device: torch.device | str,
    head_dim: int,
    root: Path | None,
) -> Kernels:
    """`family`'s kernels for `choice`: `auto` logs why it falls back to the torch `reference`;
    `mojo` raises KernelBuildError instead."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"--attention must be one of {', '.join(ATTENTION_CHOICES)}, got {choice}")
    if choice == "torch":
        return reference()
    try:
        if head_dim not in HEAD_DIMS:
            raise build.KernelBuildError(
                f"the Mojo {family} kernels support head_dim {', '.join(map(str, HEAD_DIMS))}; "
                f"this model has {head_dim}"
            )
        return load(device, root)
    except (ImportError, OSError) as exc:  # a damaged or unreadable cache entry
        error = build.KernelBuildError(
            f"cannot load the Mojo {family} kernels: {exc} (remove that cache entry to rebuild)"
        )
    except build.KernelBuildError as exc:
        error = exc
    if choice == "mojo":
        raise error
    _LOG.warning("Mojo %s kernels unavailable, using torch: %s", family, error)
    return reference()
