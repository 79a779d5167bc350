"""Compile the Mojo kernels from source into a per-machine cache keyed by the source hash.

    <cache_root>/kernels/<source key>/
        cpu-<toolchain key>/mili_attention.so    the CPU extension module (kernels/cpu.py loads it)
        sm_90/manifest.json, *.ptx               GPU kernels, ahead of time (kernels/gpu.py)

The source key hashes every `kernels/mojo/*.mojo` file and this module's build flags, so editing a
kernel rebuilds it and nothing else ever does. The CPU module also depends on the toolchain that
built it (a built `.so` hard-codes its environment's `modular/lib` path, and it is compiled for
this CPU), hence its own sub-key. PTX depends on neither: it is built here and carried to GPU
hosts, which have the driver but no Mojo toolchain.

Builds happen on first use or ahead of time (`mili kernels build`); concurrent builders (prefill
and decode starting together) serialise on a file lock and the loser finds the winner's result.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mili.cache import cache_root

_LOG = logging.getLogger("mili.kernels")

SOURCE_DIR = Path(__file__).with_name("mojo")
CPU_MODULE = "mili_attention"  # PyInit_mili_attention in kernels/mojo/mili_attention.mojo
GPU_ARCH = "sm_90"
# Bump when the way we compile changes (flags, layout of the cache) without a source change.
BUILD_VERSION = "1"
BUILD_TIMEOUT_S = 1800


class KernelBuildError(RuntimeError):
    """The Mojo toolchain is missing or failed; the message says which and what to do."""


def sources(source_dir: Path = SOURCE_DIR) -> list[Path]:
    return sorted(source_dir.glob("*.mojo"))


def source_key(source_dir: Path = SOURCE_DIR) -> str:
    """16 hex digits over every kernel source (name and bytes) and BUILD_VERSION."""
    digest = hashlib.sha256(f"mili-kernels {BUILD_VERSION}\n".encode())
    for path in sources(source_dir):
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def kernels_dir(root: Path | None = None, source_dir: Path = SOURCE_DIR) -> Path:
    return (cache_root() if root is None else root) / "kernels" / source_key(source_dir)


def gpu_kernel_dir(
    root: Path | None = None, arch: str = GPU_ARCH, source_dir: Path = SOURCE_DIR
) -> Path:
    """Where `kernels.ptx.build_gpu` puts (and kernels/gpu.py looks for) this source's PTX."""
    return kernels_dir(root, source_dir) / arch


def find_mojo() -> Path:
    """The `mojo` compiler of this environment (the `mojo-compiler` package), else on PATH."""
    candidate = Path(sys.prefix) / "bin" / "mojo"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return candidate
    found = shutil.which("mojo")
    if found:
        return Path(found)
    raise KernelBuildError(
        "Mojo toolchain not found: the attention kernels need the `mojo-compiler`, `max-core` and "
        "`max-mojo-libs` packages (installed by `make setup`); or run with --attention torch"
    )


def find_ptx(target: Path, what: str) -> Path:
    """`target` if it holds a manifest, else the PTX built here; where there is no Mojo
    toolchain either, a KernelBuildError that says so and names stale PTX it finds (PTX of
    other kernel sources under the same cache: built before kernels/mojo last changed)."""
    if (target / "manifest.json").exists():
        return target
    try:
        find_mojo()
    except KernelBuildError as e:
        kernels_root, arch_dir = target.parent.parent, target.name
        stale = sorted(
            p.parent.parent.name
            for p in kernels_root.glob(f"*/{arch_dir}/manifest.json")
            if p.parent != target
        )
        found = (
            f"; stale {arch_dir} PTX of other kernel sources is there ({', '.join(stale)})"
            if stale
            else ""
        )
        raise KernelBuildError(
            f"no {what} PTX for this kernel source at {target}{found}. Build it where Mojo is "
            f"(`mili kernels build --gpu` or ../shared/gpu/prep.sh) and carry the cache "
            f"(MILI_CACHE_DIR). {e}"
        ) from None
    return target


def toolchain_key(mojo: Path) -> str:
    """12 hex digits over the compiler's version, its location and this CPU's features."""
    version = _compiler_version(mojo)
    digest = hashlib.sha256(f"{version}\n{mojo.resolve()}\n{platform.machine()}\n".encode())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:12]


def build_cpu(
    root: Path | None = None, *, mojo: Path | None = None, source_dir: Path = SOURCE_DIR
) -> Path:
    """The path of the CPU extension module, compiling it first if this source has no build."""
    mojo = find_mojo() if mojo is None else mojo
    target_dir = kernels_dir(root, source_dir) / f"cpu-{toolchain_key(mojo)}"
    target = target_dir / f"{CPU_MODULE}.so"
    if target.exists():
        return target
    with _locked(target_dir.parent):
        if target.exists():  # another process built it while we waited
            return target
        _LOG.info("compiling Mojo CPU attention kernels into %s (first use of this source)", target)
        started = time.monotonic()
        with _staging(target_dir) as staging:
            command = [
                str(mojo),
                "build",
                "-I",
                str(source_dir),
                str(source_dir / f"{CPU_MODULE}.mojo"),
                "--emit",
                "shared-lib",
                "-o",
                str(staging / target.name),
            ]
            _compile(command, what="CPU attention kernels")
        _LOG.info("compiled Mojo CPU attention kernels in %.1f s", time.monotonic() - started)
    return target


def _compile(command: list[str], *, what: str) -> None:
    try:
        result = _run(command, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise KernelBuildError(f"compiling the {what} took over {BUILD_TIMEOUT_S} s") from exc
    if result.returncode != 0:
        raise KernelBuildError(
            f"compiling the {what} failed (exit {result.returncode}): {' '.join(command)}\n"
            + compiler_output_tail(result.stdout + result.stderr)
        )


def compiler_output_tail(output: str, lines: int = 40) -> str:
    """The end of the compiler's output without the toolchain's crash-reporter chatter."""
    kept = [line for line in output.splitlines() if "Crashpad" not in line]
    return "\n".join(kept[-lines:])


@functools.cache
def _compiler_version(mojo: Path) -> str:
    # Once per process and compiler: `mojo --version` takes seconds (tens on a loaded machine),
    # and a service asks for the CPU module twice (attention kernels, then the fused ops).
    return _run([str(mojo), "--version"], timeout=60).stdout.strip()


def _run(command: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except OSError as exc:
        raise KernelBuildError(f"cannot run the Mojo compiler {command[0]}: {exc}") from exc


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def _staging(target: Path) -> Iterator[Path]:
    """A fresh directory beside `target`, renamed onto it when the body succeeds."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield staging
        if target.exists():  # a stale partial result (e.g. PTX without a manifest)
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
