"""Which transport a prefill -> decode pair moves KV bytes over, chosen once per pair (pure,
torch-free).

The control messages (header, one chunk message per layer and prompt chunk, commit, verdict,
leases) always go over gRPC's TransferKv; only where the bytes go differs:

    transport   when                                      the bytes
    cuda-ipc    same host id, both on the same CUDA        device -> device into decode's pool
                device
    shm         same host id, both on the CPU              prefill writes decode's pool in
                                                           POSIX shared memory
    grpc        otherwise (or forced)                      in KvChunk.data

The host id names what shared memory needs in common: the kernel boot (boot_id) and the IPC
and mount namespaces (/dev/shm). Two processes with equal ids see the same /dev/shm.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

_LOG = logging.getLogger("mili.kv_handoff")
GRPC = "grpc"
SHM = "shm"
CUDA_IPC = "cuda-ipc"
TRANSPORTS = (CUDA_IPC, SHM, GRPC)  # fastest first
AUTO = "auto"
CHOICES = (AUTO, *TRANSPORTS)  # the --kv-transport flag: auto picks the fastest both can use


class Endpoint(NamedTuple):
    """One side of a pair: where it runs and what it can use."""

    host_id: str
    device: str  # "cpu", "cuda:0", ...
    transports: tuple[str, ...]  # fastest first


def host_id() -> str:
    """This process's host identity: boot id and the IPC and mount namespaces (read from /proc;
    called at start-up, never at import). Empty when /proc does not say (then only grpc)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespaces = [str(os.stat(f"/proc/self/ns/{ns}").st_ino) for ns in ("ipc", "mnt")]
    except OSError:
        return ""
    return ":".join([boot, *namespaces])


def usable(device: str, allowed: str = AUTO) -> tuple[str, ...]:
    """The transports a process on `device` offers, fastest first; `allowed` (a CHOICES value)
    narrows them to one (grpc is always possible)."""
    offered = (CUDA_IPC, GRPC) if device.startswith("cuda") else (SHM, GRPC)
    if allowed == AUTO:
        return offered
    if allowed not in TRANSPORTS:
        raise ValueError(f"--kv-transport must be one of {', '.join(CHOICES)}, got {allowed!r}")
    if allowed not in offered:  # forced, so said: every pair would quietly take grpc
        _LOG.warning(
            "--kv-transport %s cannot be used on %s (it offers %s): every transfer takes grpc",
            allowed,
            device,
            " and ".join(offered),
        )
        return (GRPC,)
    return (allowed,)


def choose(sender: Endpoint, receiver: Endpoint) -> str:
    """The fastest transport both sides offer; the shared-memory ones only on one host, and
    cuda-ipc only on one device: its copies run on prefill's device into decode's pool and
    were never written (nor run) for two GPUs, where grpc is correct."""
    same_host = bool(sender.host_id) and sender.host_id == receiver.host_id
    for transport in TRANSPORTS:
        if transport not in sender.transports or transport not in receiver.transports:
            continue
        if transport != GRPC and not same_host:
            continue
        if transport == CUDA_IPC and sender.device != receiver.device:
            continue
        return transport
    return GRPC


class TransportConfig(NamedTuple):
    """--kv-transport and --host-id, built once in a service's entry point."""

    allowed: str = AUTO  # a CHOICES value
    host_id: str | None = None  # None: host_id() of this process; tests inject others

    def endpoint(self, device: str) -> Endpoint:
        return Endpoint(
            host_id() if self.host_id is None else self.host_id,
            device,
            usable(device, self.allowed),
        )
