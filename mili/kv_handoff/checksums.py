"""The checksums KV chunks carry, chosen per pair (KvTransferService.Pair): XXH3-64 when both
sides have the `xxhash` package (several GB/s per core, where zlib's CRC-32 does ~1 GB/s on a
loaded CPU, see docs/benchmarks.md), else CRC-32. Both run over buffers in place. zlib's CRC-32
releases the GIL on large buffers; xxhash only in its one-shot function (`digest` of a single
buffer), not in the streaming object's update, which other threads then wait for."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from types import ModuleType

CRC32 = "crc32"
XXH3_64 = "xxh3-64"


def _xxhash() -> ModuleType | None:
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash


def available() -> tuple[str, ...]:
    """The checksums this process can compute, fastest first."""
    return (XXH3_64, CRC32) if _xxhash() is not None else (CRC32,)


def choose(offered: Iterable[str]) -> str:
    """The first of the peer's `offered` (fastest first) this process has too; CRC-32 else."""
    mine = available()
    return next((name for name in offered if name in mine), CRC32)


class Running:
    """`name`'s digest over buffers given one at a time (`update`), equal to `digest` of them
    all: lets a caller checksum a piece just before it copies it, while it is in cache."""

    def __init__(self, name: str) -> None:
        self._crc: int | None = None
        self._state = None
        if name == CRC32:
            self._crc = 0
            return
        module = _xxhash()
        if name != XXH3_64 or module is None:
            raise ValueError(f"checksum {name!r} is not available here ({', '.join(available())})")
        self._state = module.xxh3_64()

    def update(self, buf: memoryview | bytes) -> None:
        if self._state is None:
            self._crc = zlib.crc32(buf, self._crc or 0)
        else:
            self._state.update(buf)

    def value(self) -> int:
        return int(self._state.intdigest()) if self._state is not None else (self._crc or 0)


def digest(name: str, buffers: Iterable[memoryview | bytes]) -> int:
    """`name`'s digest of the buffers' bytes one after another."""
    if name == XXH3_64 and isinstance(buffers, Sequence) and len(buffers) == 1:
        module = _xxhash()
        if module is not None:
            # One buffer (a grpc chunk's data): the one-shot function releases the GIL, the
            # streaming object's update does not (docs/benchmarks.md).
            return int(module.xxh3_64_intdigest(buffers[0]))
    running = Running(name)
    for buf in buffers:
        running.update(buf)
    return running.value()
