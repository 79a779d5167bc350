"""Load every Mojo kernel entry this source has, as serving would, and say what each costs.

    python3 benchmarks/kernel_load.py                  # GPU host, the PTX carried over
    python3 benchmarks/kernel_load.py --device cpu     # the CPU extension module

cuda: every sm_90 PTX entry of the attention and fused manifests is JIT-compiled through the
project's own loader (kernels/gpu.py, kernels/fused/gpu.py: the path a launch takes), then one
line per entry: registers, max threads per block, static + dynamic shared memory, local
(spilled) bytes and CTAs per SM at the block size it launches with. A missing manifest (no PTX of
this source: never built, or built from other sources, which the cache keys apart) is named with
the builds the cache does hold.

cpu: the extension module of this source is imported and its entries listed.

A failure is printed and counted, not raised, so one bad entry does not hide the others; exit 1
if any entry failed or a manifest is missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import build

# Threads per block each kernel launches with (None: head_dim threads), for the occupancy column.
BLOCK_THREADS = {"decode_combine": None, "add_rms_norm": 256, "silu_mul": 256}
DEFAULT_BLOCK_THREADS = 128


def missing(kernel_dir: Path) -> str:
    """Why `kernel_dir` has no manifest, with the PTX builds the cache holds instead."""
    source_dir = kernel_dir.parent
    others = sorted(
        p.parent.parent.name + "/" + p.parent.name
        for p in source_dir.parent.glob(f"*/{kernel_dir.name}/manifest.json")
    )
    held = ", ".join(others) if others else "none"
    return (
        f"MISSING {kernel_dir}/manifest.json: no PTX of this source (key {source_dir.name}); "
        f"PTX builds in this cache: {held}. Build it where Mojo is "
        "(`MILI_CACHE_DIR=<dir> mili kernels build --gpu --no-cpu`) and carry <dir> over"
    )


def cuda_attributes(func: Any, block: int, dynamic_shared: int) -> str:
    """The driver's view of one loaded function; "" where cuda-python is not installed."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6
        except ImportError:
            return ""
    attribute = driver.CUfunction_attribute

    def get(name: str) -> object:
        err, value = driver.cuFuncGetAttribute(getattr(attribute, name), func)
        return value if err == driver.CUresult.CUDA_SUCCESS else f"err {err}"

    err, per_sm = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, block, dynamic_shared)
    return (
        f"regs={get('CU_FUNC_ATTRIBUTE_NUM_REGS')} "
        f"maxthr={get('CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK')} "
        f"smem={get('CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES')}+{dynamic_shared} "
        f"local={get('CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES')} "
        f"ctas/SM@{block}={per_sm if err == driver.CUresult.CUDA_SUCCESS else err}"
    )


def load_cuda() -> int:
    """JIT every PTX entry; the number of failures (a missing manifest counts as one)."""
    import torch

    from kernels.fused.gpu import GpuFusedKernels
    from kernels.fused.ptx import fused_kernel_dir
    from kernels.gpu import GpuKernels

    torch.zeros(1, device="cuda")  # the loaders use torch's primary context: create it first
    failures = 0
    families: list[tuple[type[GpuKernels] | type[GpuFusedKernels], Path]] = [
        (GpuKernels, build.gpu_kernel_dir()),
        (GpuFusedKernels, fused_kernel_dir()),
    ]
    for cls, kernel_dir in families:
        if not (kernel_dir / "manifest.json").exists():
            failures += 1
            print(f"# {cls.__name__}: {missing(kernel_dir)}", flush=True)
            continue
        kernels = cls(kernel_dir)
        records = kernels.manifest["kernels"]
        print(f"# {cls.__name__}: {kernel_dir} ({len(records)} entries)", flush=True)
        for rec in records:
            key = (rec["kernel"], rec["dtype"], rec["head_dim"])
            try:
                # The loader launches go through (private: there is no public load-only call).
                loaded = kernels._function(0, *key)
            except Exception as exc:
                failures += 1
                print(f"FAIL {key}: {type(exc).__name__}: {exc}"[:400], flush=True)
                continue
            # The attention loader returns (function, dynamic shared bytes); the fused one the
            # function alone (no dynamic shared memory).
            func, dynamic_shared = loaded if isinstance(loaded, tuple) else (loaded, 0)
            block = BLOCK_THREADS.get(rec["kernel"], DEFAULT_BLOCK_THREADS) or rec["head_dim"]
            print(
                f"ok {rec['kernel']:16} {rec['dtype']:9} D={rec['head_dim']:<3} "
                + cuda_attributes(func, block, dynamic_shared),
                flush=True,
            )
    return failures


def load_cpu() -> int:
    """Import this source's CPU extension module (compiling it first where Mojo is)."""
    from kernels.cpu import load_module

    try:
        path = build.build_cpu()
        module = load_module(path)
    except (build.KernelBuildError, ImportError) as exc:
        print(f"FAIL CPU kernels: {type(exc).__name__}: {exc}"[:400], flush=True)
        return 1
    entries = sorted(n for n in dir(module) if not n.startswith("_"))
    print(f"# CPU module: {path} ({len(entries)} entries)", flush=True)
    for name in entries:
        print(f"ok {name}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    failures = load_cuda() if args.device == "cuda" else load_cpu()
    print(f"# {failures} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
