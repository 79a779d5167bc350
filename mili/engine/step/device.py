"""Which CUDA device a thread runs on, and whether a --device exists here."""

from __future__ import annotations

import contextlib

import torch

from mili.errors import StartupError


def use_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (nothing on the CPU): events,
    streams and graph captures made without a device take the current one, which is cuda:0 in
    every thread until it says otherwise. Called by each thread that runs the model."""
    if device.type == "cuda":
        # torch 2.11 refuses a device without an index here; plain "cuda" means the current one.
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_device(index)


def settle(device: torch.device) -> None:
    """Wait until `device` has run everything the calling thread queued on it (CUDA; nothing
    on the CPU, where the work is done when the call returns). Before blocks the queued work
    writes go back to a pool whose next owner may be written from another stream or process."""
    if device.type == "cuda":
        with contextlib.suppress(Exception):  # a broken device: nothing more to wait for
            torch.cuda.current_stream(device).synchronize()


def require_device(device: str) -> None:
    """StartupError unless `device` (cpu, cuda, cuda:N) exists here."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise StartupError(f"--device {device}: no CUDA device is available")
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            raise StartupError(
                f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
