"""`mili kernels build`: compile the Mojo attention kernels into the cache ahead of first use.

Prints where each artifact lives. `--gpu` also emits the sm_90 PTX (no GPU needed to build it);
copy that directory to a GPU host and point MILI_CACHE_DIR at its cache root, or use
`--cache-dir` to build straight into a folder you will carry.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from mili.errors import StartupError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["build"], help="what to do (build)")
    parser.add_argument("--gpu", action="store_true", help="also build the sm_90 GPU kernels")
    parser.add_argument(
        "--no-cpu", action="store_true", help="skip the CPU extension module (with --gpu)"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache root (default: $MILI_CACHE_DIR, else $XDG_CACHE_HOME/mili, else ~/.cache/mili)",
    )


def run(args: argparse.Namespace) -> int:
    from kernels import build, ptx

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.monotonic()
    try:
        if not args.no_cpu:
            print(f"cpu: {build.build_cpu(args.cache_dir)}")
        if args.gpu:
            print(f"{build.GPU_ARCH}: {ptx.build_gpu(args.cache_dir)}")
            from kernels.fused.ptx import build_fused_gpu

            print(f"{build.GPU_ARCH} fused: {build_fused_gpu(args.cache_dir)}")
    except build.KernelBuildError as exc:
        raise StartupError(str(exc)) from exc
    print(f"kernels for source {build.source_key()} ready in {time.monotonic() - started:.1f} s")
    return 0
