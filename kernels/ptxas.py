"""CUDA's PTX assembler, where one is installed: the attention kernels' build (kernels/ptx.py)
assembles every PTX file for sm_90a with `ptxas -v` and records its registers, spills and shared
memory in the manifest. No torch import.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path


def find_ptxas() -> Path | None:
    """CUDA's PTX assembler where one is installed (GPU hosts, some CI images), else None."""
    found = shutil.which("ptxas")
    if found:
        return Path(found)
    default = Path("/usr/local/cuda/bin/ptxas")
    return default if default.is_file() else None


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(stderr: str) -> dict[str, int]:
    """`ptxas -v` output of one entry -> registers, stack/spill bytes and static shared memory."""
    regs = _PTXAS_REGS.search(stderr)
    spills = _PTXAS_SPILLS.search(stderr)
    if regs is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v output:\n{stderr[-2000:]}")
    smem = _PTXAS_SMEM.search(stderr)
    return {
        "registers": int(regs.group(1)),
        "stack_bytes": int(spills.group(1)),
        "spill_store_bytes": int(spills.group(2)),
        "spill_load_bytes": int(spills.group(3)),
        "static_shared_bytes": int(smem.group(1)) if smem else 0,
    }


def ptxas_info(ptxas: Path, ptx_file: Path, arch: str = "sm_90") -> dict[str, int]:
    """Assemble one PTX file for `arch`a (the PTX targets sm_90a) and parse `ptxas -v`."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [str(ptxas), f"-arch={arch}a", "-v", str(ptx_file), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas rejected {ptx_file.name}:\n{proc.stderr[-2000:]}")
    return parse_ptxas(proc.stderr)
