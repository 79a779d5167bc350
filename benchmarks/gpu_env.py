"""What the GPU check's host has: versions, the device, the modules serving imports, and whether
this source's Mojo kernels are there (the first thing benchmarks/gpu_check.sh records).

    python3 benchmarks/gpu_env.py              # GPU host
    python3 benchmarks/gpu_env.py --device cpu

One line per fact; a problem line starts with IMPORT FAIL or MISSING (gpu_check.sh counts them).
The PTX is keyed by the kernel sources' hash, so PTX built from other sources (stale) shows as
MISSING with the builds the cache does hold. Exit 1 if any problem was found.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel_load import missing
from kernels import build
from kernels.build import CPU_MODULE
from kernels.fused.ptx import fused_kernel_dir

# What the services import beyond torch (the GPU image lacks some: prep.sh carries wheels).
SERVING_MODULES = (
    "grpc",
    "google.protobuf",
    "grpc_health",
    "grpc_reflection",
    "grpc_status",
    "opentelemetry.sdk",
    "prometheus_client",
    "xxhash",
    "transformers",
    "llguidance",  # structured output; the servers import it (gpu_prep.sh carries its wheel)
)
CUDA_MODULES = ("cuda.bindings", "cupy")  # the PTX loader's driver bindings: one of them


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    print(
        f"python {sys.version.split()[0]} torch {torch.__version__} cuda {torch.version.cuda} "
        f"MILI_CACHE_DIR={os.environ.get('MILI_CACHE_DIR', '(unset)')}"
    )
    if args.device == "cuda":
        print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))
    else:
        print(f"device cpu {platform.machine()}: {os.cpu_count()} cores, load {os.getloadavg()}")
    problems = 0
    cuda_imports = []
    for name in SERVING_MODULES + (CUDA_MODULES if args.device == "cuda" else ()):
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            if name not in CUDA_MODULES:
                problems += 1
            print(
                "IMPORT FAIL" if name not in CUDA_MODULES else "no", name, type(exc).__name__, exc
            )
            continue
        if name in CUDA_MODULES:
            cuda_imports.append(name)
        print(
            "import ok", name, getattr(module, "__version__", ""), getattr(module, "__file__", "")
        )
    if args.device == "cuda":
        if not cuda_imports:
            problems += 1
            print("IMPORT FAIL cuda.bindings and cupy: the PTX loader needs one")
        for kernel_dir in (build.gpu_kernel_dir(), fused_kernel_dir()):
            if (kernel_dir / "manifest.json").exists():
                print("PTX", kernel_dir, "manifest present")
            else:
                problems += 1
                print(missing(kernel_dir))
    else:
        built = sorted(build.kernels_dir().glob(f"cpu-*/{CPU_MODULE}.so"))
        if built:
            print("CPU kernels", ", ".join(map(str, built)))
        else:  # the kernel tests build it (a few minutes): worth knowing why they are slow
            print(
                f"CPU kernels not built yet under {build.kernels_dir()}: the first use builds them"
            )
    print(f"# {problems} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
