"""`MojoAttention`, the AttentionBackend on the Mojo kernels, and the `--attention` choice.

    --attention torch   the torch reference (mili.engine.attention.TorchAttention)
    --attention mojo    the Mojo kernels; a missing or failing toolchain stops the service
    --attention auto    (default) Mojo where the kernels build for the device, else torch

The engine never imports this package: MojoAttention satisfies the AttentionBackend Protocol
structurally, and services pick a backend here once at start-up and hand it to the model.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import torch

from kernels import build, ptx
from kernels.checks import HEAD_DIMS
from kernels.cpu import CpuKernels
from mili.engine.engine_config import ATTENTION_CHOICES
from mili.engine.model.attention import AttentionBackend, TorchAttention

_LOG = logging.getLogger("mili.kernels")


class AttentionKernels(Protocol):
    """What kernels/cpu.py's CpuKernels and kernels/gpu.py's GpuKernels both provide."""

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cu_seqlens: torch.Tensor,
        start_positions: torch.Tensor,
        block_tables: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor: ...

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        scale: float,
        num_splits: int = 0,
    ) -> torch.Tensor: ...


class MojoAttention:
    """Prefill FlashAttention and paged decode on the Mojo kernels of one device type.

    Reads every key and value — cached prefix and new tokens alike — from the paged cache (the
    model writes the new tokens' K/V there before calling attention), so `k`/`v` go unused.
    """

    name = "mojo"

    def __init__(self, kernels: AttentionKernels, device_type: str) -> None:
        self._kernels = kernels
        self._device_type = device_type
        # Graph-safe only where the kernels object says so (mili.engine.model.attention's contract):
        # never on CPU (CUDA graphs are CUDA's), on the GPU once its kernels declare
        # `is_graph_safe = True`.
        self.is_graph_safe = device_type == "cuda" and bool(
            getattr(kernels, "is_graph_safe", False)
        )

    def _check_device(self, q: torch.Tensor) -> None:
        if q.device.type != self._device_type:
            raise ValueError(
                f"these Mojo kernels were loaded for {self._device_type}, q is on {q.device}"
            )

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        start_positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        self._check_device(q)
        return self._kernels.prefill(
            q, k_cache, v_cache, cu_seqlens, start_positions, block_tables, scale=scale
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        self._check_device(q)
        return self._kernels.decode(q, k_cache, v_cache, block_tables, seq_lens, scale=scale)


def load_mojo_attention(device: torch.device | str, root: Path | None = None) -> MojoAttention:
    """Build (or find in the cache) the kernels for `device`; KernelBuildError if impossible."""
    device = torch.device(device)
    if device.type == "cpu":
        return MojoAttention(CpuKernels.from_path(build.build_cpu(root)), "cpu")
    if device.type == "cuda":
        from kernels.gpu import GpuKernels

        # GPU hosts usually lack the toolchain: PTX is built where Mojo is and carried over.
        ptx_dir = build.find_ptx(build.gpu_kernel_dir(root), "attention")
        if not (ptx_dir / "manifest.json").exists():
            ptx_dir = ptx.build_gpu(root)
        return MojoAttention(GpuKernels(ptx_dir), "cuda")
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
        backend: AttentionBackend = load_mojo_attention(device, root)
    except build.KernelBuildError as exc:
        if choice == "mojo":
            raise
        _LOG.warning("Mojo attention kernels unavailable, using torch attention: %s", exc)
        return TorchAttention()
    return backend
