"""Static instruction counts of a GPU kernel's hot loop, from its PTX, without a GPU.

Each PTX file is assembled for sm_90a by `ptxas` and disassembled by `nvdisasm`; the loop
printed is the smallest backward branch whose body both waits on cp.async (DEPBAR.LE) and
shuffles (SHFL): for paged_decode, the per-tile loop. Counts are static (every instruction in
the loop's body once, branches not taken included), so they compare two builds of one kernel,
not two kernels' speed; with the measured copy rate they say whether a kernel can be issue-bound
(docs/benchmarks.md, "paged decode: instructions per tile").

    python3 -m pip download --no-deps -d /tmp/nvd nvidia-cuda-nvdisasm   # nvdisasm, once
    (cd /tmp/nvd && unzip -o -q nvidia_cuda_nvdisasm-*.whl)
    .venv/bin/python benchmarks/kernel_sass.py --nvdisasm /tmp/nvd/nvidia/cu13/bin/nvdisasm \\
        OLD/sm_90/paged_decode_g4_bfloat16_128.ptx NEW/sm_90/paged_decode_g4_bfloat16_128.ptx
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
_LABEL = re.compile(r"\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+(?:!?U?P\d,\s*)?`\((\.L_x_\d+)\)")
SHOWN = ("IMAD", "IADD3", "ISETP", "SEL", "CALL", "I2F", "LDS", "LDGSTS", "SHFL", "FFMA", "MUFU")


def sass(ptx: Path, nvdisasm: str) -> list[str]:
    """The kernel's SASS lines: ptxas for sm_90a (our PTX targets it), then nvdisasm."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        subprocess.run(["ptxas", "-arch=sm_90a", "-o", str(cubin), str(ptx)], check=True)
        out = subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True)
    return out.stdout.decode().splitlines()


def hot_loop(lines: list[str]) -> list[str]:
    """The smallest backward branch's body that holds both a cp.async wait and a shuffle."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    best: list[str] | None = None
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if not m or labels.get(m.group(1), i) >= i:
            continue
        body = lines[labels[m.group(1)] : i + 1]
        is_hot = any("DEPBAR.LE" in b for b in body) and any("SHFL" in b for b in body)
        if is_hot and (best is None or len(body) < len(best)):
            best = body
    if best is None:
        raise SystemExit("no loop with both a cp.async wait and a shuffle")
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ptx", nargs="+", type=Path, help="PTX files (one kernel each)")
    parser.add_argument("--nvdisasm", default="nvdisasm", help="nvdisasm executable")
    args = parser.parse_args()
    print("| PTX | loop instructions | " + " | ".join(SHOWN) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in SHOWN) + " |")
    for ptx in args.ptx:
        ops = collections.Counter(
            m.group(1)
            for line in hot_loop(sass(ptx, args.nvdisasm))
            if (m := _INSTRUCTION.search(line))
        )
        row = " | ".join(str(ops[op]) for op in SHOWN)
        print(f"| {ptx.parent.parent.name}/{ptx.name} | {sum(ops.values())} | {row} |")


if __name__ == "__main__":
    main()
