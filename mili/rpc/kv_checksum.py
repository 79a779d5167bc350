"""The checksums KV chunks carry, chosen per pair (KvTransferService.Pair): XXH3-64 when both
sides have the `xxhash` package (several GB/s per core, where zlib's CRC-32 does ~1 GB/s on a
loaded CPU, see docs/benchmarks.md), else CRC-32. Both run over buffers in place and release
the GIL on large ones."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
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


def digest(name: str, buffers: Iterable[memoryview | bytes]) -> int:
    """`name`'s digest of the buffers' bytes one after another."""
    if name == CRC32:
        crc = 0
        for buf in buffers:
            crc = zlib.crc32(buf, crc)
        return crc
    module = _xxhash()
    if name != XXH3_64 or module is None:
        raise ValueError(f"checksum {name!r} is not available here ({', '.join(available())})")
    state = module.xxh3_64()
    for buf in buffers:
        state.update(buf)
    return int(state.intdigest())
