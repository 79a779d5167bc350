"""The `--attention` choice: the torch reference or the Mojo kernels of the device.

    --attention torch   the torch reference (mili.engine.model.attention.TorchAttention)
    --attention mojo    the Mojo kernels; a missing or failing toolchain stops the service
    --attention auto    (default) Mojo where the kernels build for the device, else torch

The engine never imports this package: kernels/cpu.py's CpuKernels and kernels/gpu.py's
GpuKernels satisfy the AttentionBackend Protocol structurally, and services pick a backend here
once at start-up and hand it to the model.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kernels import build, ptx
from kernels.checks import HEAD_DIMS
from kernels.cpu import CpuKernels
from mili.engine.engine_config import ATTENTION_CHOICES
from mili.engine.model.attention import AttentionBackend, TorchAttention

_LOG = logging.getLogger("mili.kernels")


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


def select_attention(
    choice: str, device: torch.device | str, *, head_dim: int, root: Path | None = None
) -> AttentionBackend:
    """The backend `--attention choice` means for a model with `head_dim` on `device`.

    `auto` logs why it falls back to torch; `mojo` raises KernelBuildError instead.
    """
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"--attention must be one of {', '.join(ATTENTION_CHOICES)}, got {choice}")
    if choice == "torch":
        return TorchAttention()
    try:
        if head_dim not in HEAD_DIMS:
            raise build.KernelBuildError(
                f"the Mojo kernels support head_dim {', '.join(map(str, HEAD_DIMS))}; "
                f"this model has {head_dim}"
            )
        backend = load_mojo_attention(device, root)
    except build.KernelBuildError as exc:
        if choice == "mojo":
            raise
        _LOG.warning("Mojo attention kernels unavailable, using torch attention: %s", exc)
        return TorchAttention()
    return backend
