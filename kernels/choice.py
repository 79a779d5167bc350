"""`select_kernels`: the kernels a prefill or decode instance runs, checked before it serves.

    --attention torch  the torch references: attention and fused ops (no Mojo at all)
    --attention mojo   the Mojo kernels; a missing toolchain or PTX, or a kernel that fails the
                       start-up self-check (kernels/self_check.py), stops the service
    --attention auto   (default) per family (attention; fused ops), the Mojo kernels where
                       they load and pass the self-check, else torch, with one log line naming
                       the kernel and what went wrong; a family that can do without the
                       failing kernel alone (`fall_back(kernel)`: the GPU's split decode, its
                       gemv) keeps its other kernels

One flag picks the kernel family of a process, so `--attention torch` runs the model on torch
alone (the reference end to end).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kernels.build import KernelBuildError
from kernels.checks import DTYPE_CODES
from kernels.self_check import (
    ATTENTION,
    FUSED,
    CheckShape,
    KernelFault,
    check_isolated,
    check_kernels,
    load_family,
)
from mili.engine.engine_config import ATTENTION_CHOICES
from mili.engine.model.attention import AttentionBackend, TorchAttention
from mili.engine.model.fused_ops import FusedOps, TorchFusedOps

_LOG = logging.getLogger("mili.kernels")

# (family, device, head_dim) -> the family's Mojo implementation; KernelBuildError if none.
Loader = Callable[[str, str, int], Any]


class Kernels(NamedTuple):
    """What a service runs, and why a family it asked Mojo for runs on torch."""

    attention: AttentionBackend
    fused_ops: FusedOps
    faults: tuple[KernelFault, ...] = ()  # self-check failures that made `auto` fall back


def select_kernels(
    choice: str,
    device: str,
    shape: CheckShape,
    *,
    root: Path | None = None,
    load: Loader | None = None,
    isolate: bool | None = None,
) -> Kernels:
    """The kernels `--attention choice` means on `device` for a model of `shape`.

    `load` replaces `load_family` (tests hand in kernels made to fail); `isolate` (default:
    on CUDA) runs the self-check in child processes, one per family, which load the kernels
    with `load_family` themselves. KernelBuildError when `choice` is mojo and a kernel is
    unavailable or fails the check.
    """
    torch_kernels = Kernels(TorchAttention(), TorchFusedOps())
    if choice == "torch":
        return torch_kernels
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"--attention must be one of {', '.join(ATTENTION_CHOICES)}, got {choice}")
    if shape.dtype not in _DTYPES:
        error = KernelBuildError(
            f"the Mojo kernels run {', '.join(_DTYPES)}; this model runs in {shape.dtype}"
        )
        if choice == "mojo":
            raise error
        _LOG.warning("Mojo kernels unavailable, using torch: %s", error)
        return torch_kernels
    loader: Loader = load or (lambda family, d, head_dim: load_family(family, d, head_dim, root))
    loaded: dict[str, Any] = {}
    for family in (ATTENTION, FUSED):
        try:
            loaded[family] = loader(family, device, shape.head_dim)
        except KernelBuildError as e:
            if choice == "mojo":
                raise
            _LOG.warning("Mojo %s kernels unavailable, using torch: %s", _NAMES[family], e)
    if not loaded:
        return torch_kernels
    if isolate if isolate is not None else torch.device(device).type == "cuda":
        faults = check_isolated(shape, device, list(loaded), root=root)
    else:
        faults = check_kernels(shape, device, loaded)
    for fault in faults:
        if choice == "mojo":
            raise KernelBuildError(f"a Mojo kernel failed its start-up self-check: {fault}")
        implementation = loaded.get(fault.family)
        fall_back = getattr(implementation, "fall_back", None)
        if fall_back is not None and fall_back(fault.kernel):
            _LOG.warning(
                "a Mojo kernel failed its start-up self-check, its work alone runs without it "
                "(the other %s kernels stay): %s",
                _NAMES[fault.family],
                fault,
            )
        elif implementation is not None:
            _LOG.warning(
                "a Mojo kernel failed its start-up self-check, %s kernels run on torch: %s",
                _NAMES[fault.family],
                fault,
            )
            del loaded[fault.family]
    return Kernels(
        loaded.get(ATTENTION, torch_kernels.attention),
        loaded.get(FUSED, torch_kernels.fused_ops),
        tuple(faults),
    )


_NAMES = {ATTENTION: "attention", FUSED: "fused-op"}
_DTYPES = tuple(str(dtype).removeprefix("torch.") for dtype in DTYPE_CODES)  # what the kernels run
