"""`select_fused_ops`: the FusedOps a service runs, chosen like its attention backend.

    torch   mili.engine.fused_ops.TorchFusedOps, the reference
    mojo    the Mojo kernels of the device (kernels/fused/cpu.py; no sm_90 version yet, so a
            GPU falls back to torch); a missing or failing toolchain stops the service
    auto    Mojo where the kernels build for the device and the model's head_dim, else torch

Services pass their `--attention` choice: one flag picks the kernel family of a process, so
`--attention torch` runs the model on torch alone (the reference end to end).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kernels import ATTENTION_CHOICES, build
from kernels.checks import HEAD_DIMS
from kernels.fused.cpu import CpuFusedKernels
from mili.engine.fused_ops import FusedOps, TorchFusedOps

_LOG = logging.getLogger("mili.kernels")


def load_mojo_fused_ops(device: torch.device | str, root: Path | None = None) -> FusedOps:
    """Build (or find in the cache) the fused kernels for `device`; KernelBuildError if not."""
    device = torch.device(device)
    if device.type == "cpu":
        return CpuFusedKernels.from_path(build.build_cpu(root))
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
    if torch.device(device).type != "cpu":
        # No sm_90 fused kernels yet: the attention kernels alone decide what `mojo` requires.
        _LOG.info("no Mojo fused kernels for %s: using the torch reference ops", device)
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
