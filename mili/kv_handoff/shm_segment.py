"""A KV pool in POSIX shared memory: one segment per pool, mapped once by its owner (decode) and
once per pair by each sender (prefill), which then writes prompt blocks straight into it.

    /dev/shm/mili-kv-<owner pid>-<nonce>        one file, `kv_cache.pool_bytes(...)` long:

    offset 0
    │ layer 0 K │ layer 0 V │ layer 1 K │ layer 1 V │ ...     each [num_blocks, block_size,
                                                               num_kv_heads, head_dim], C order

Leaks: the owner unlinks its segment when it closes; a segment whose owner died (SIGKILL,
power cut of the process) is found by its name's pid and unlinked by `sweep_stale`, which the
next owner runs at start-up and a sender runs when its pair breaks. A sender's mapping keeps
the memory alive after an unlink only until the sender drops it (it does so when the pair
breaks), so no segment survives the processes that use it.
"""

from __future__ import annotations

import mmap
import os
import secrets
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "mili-kv-"


def _owner_pid(name: str) -> int | None:
    pid, _, _ = name.removeprefix(PREFIX).partition("-")
    return int(pid) if name.startswith(PREFIX) and pid.isdigit() else None


def is_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (killed, not reaped by its parent yet) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]  # after "pid (comm)"
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def sweep_stale(directory: Path = SHM_DIR) -> list[Path]:
    """Unlink MILI segments whose owner process is gone; returns what it removed."""
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = _owner_pid(name)
        if pid is not None and not is_alive(pid):
            path = directory / name
            try:
                path.unlink()
            except OSError:
                continue  # another sweeper got it first, or not ours to remove
            removed.append(path)
    return removed


def segments_of(pid: int, directory: Path = SHM_DIR) -> list[Path]:
    """The MILI segments named after `pid` (for tests and tools)."""
    try:
        return [directory / n for n in os.listdir(directory) if _owner_pid(n) == pid]
    except OSError:
        return []


def _map(fd: int, num_bytes: int) -> mmap.mmap:
    """Map the whole segment with its page-table entries filled now (MAP_POPULATE, Linux): a
    first write to each 4 KiB page otherwise faults, which made a pair's first transfers into
    blocks not yet touched 10-40x slower than later ones (docs/benchmarks.md)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, num_bytes, flags=flags)


class Segment:
    """A mapped segment; `tensor` is its bytes as a flat uint8 tensor (no copy)."""

    def __init__(self, path: Path, mapping: mmap.mmap, *, is_owner: bool) -> None:
        self.path = path
        self.is_owner = is_owner
        self._mmap: mmap.mmap | None = mapping
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)

    @classmethod
    def create(cls, num_bytes: int, directory: Path = SHM_DIR) -> Segment:
        """A new zero-filled segment named after this process (stale ones swept first)."""
        sweep_stale(directory)
        path = directory / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Zeros, every page allocated now: a /dev/shm too small for the pool (a container's
            # 64 MB default) fails here with ENOSPC, not later with SIGBUS mid-step.
            os.posix_fallocate(fd, 0, num_bytes)
            mapping = _map(fd, num_bytes)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        return cls(path, mapping, is_owner=True)

    @classmethod
    def attach(cls, path: str | Path, num_bytes: int) -> Segment:
        """Map an existing segment; ValueError when its size is not `num_bytes`."""
        path = Path(path)
        if not path.name.startswith(PREFIX):
            raise ValueError(f"{path} is not a MILI KV segment")
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != num_bytes:
                raise ValueError(f"{path} holds {size} bytes, expected {num_bytes}")
            mapping = _map(fd, num_bytes)
        finally:
            os.close(fd)
        return cls(path, mapping, is_owner=False)

    @property
    def owner_pid(self) -> int | None:
        return _owner_pid(self.path.name)

    def close(self) -> None:
        """Drop our hold on the mapping; the owner also unlinks the file. The memory is unmapped
        when the last view of `tensor` goes too (a transfer may still be writing through one).
        Never mmap.close() here: torch.frombuffer keeps a reference to the mmap but no buffer
        export, so close() would unmap the pages under live tensors (a crash at their next
        write) instead of refusing."""
        if self.is_owner:
            self.path.unlink(missing_ok=True)
        if self._mmap is not None:
            self._mmap = None
            del self.tensor
