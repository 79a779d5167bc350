"""PTX entries of a generated Mojo module: `compile_entries` builds it with `mojo build
--target-accelerator=<arch> --emit asm` (one self-contained PTX file per kernel, with
hash-suffixed `.visible .entry` names), `parse_entries` reads a PTX text's entries and their
parameter types, `pick_entry` finds one wrapper's entry by its name, `check_signature` checks
its parameters against a signature table; `MOJO_DTYPE`, `MOJO_SCALAR` and `SHORT_DTYPE` spell
the wrappers' types and names in the generated module.

Shared by the attention kernels' build (kernels/ptx.py) and the fused kernels'
(kernels/fused/ptx.py); their loaders (kernels/gpu.py, kernels/fused/gpu.py) parse a PTX file's
entries again when they load it and check them the same way. No torch import.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from kernels import build

# Mojo spelling of each dtype and scalar parameter kind in a generated wrapper.
MOJO_DTYPE = {"float32": "DType.float32", "bfloat16": "DType.bfloat16", "float16": "DType.float16"}
MOJO_SCALAR = {"i32": "Int32", "f32": "Float32"}
# A dtype in a wrapper's name: PTX entry names keep only their first ~30 characters.
SHORT_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
# PTX type of each signature parameter kind: a device pointer is .u64, both scalars .b32.
PTX_PARAM_TYPE = {"ptr": ".u64", "i32": ".b32", "f32": ".b32"}

_ENTRY_RE = re.compile(r"\.visible\s+\.entry\s+([A-Za-z0-9_$]+)\s*\(([^)]*)\)", re.S)
_PARAM_RE = re.compile(r"\.param\s+(\.[a-z0-9]+)")


def parse_entries(ptx: str) -> dict[str, list[str]]:
    """`.visible .entry` names of a PTX text -> their parameter types (".u64", ".b32", ...)."""
    return {m.group(1): _PARAM_RE.findall(m.group(2)) for m in _ENTRY_RE.finditer(ptx)}


def check_signature(
    signatures: Mapping[str, Sequence[tuple[str, str]]], kernel: str, params: list[str]
) -> None:
    """RuntimeError unless `params` (an entry's PTX parameter types) are `kernel`'s in
    `signatures` (a kernels.signatures or kernels.fused.ptx table): the loader packs its launch
    arguments from that table, so it and the PTX cannot drift apart silently."""
    want = [PTX_PARAM_TYPE[kind] for _, kind in signatures[kernel]]
    if params != want:
        raise RuntimeError(f"{kernel}: PTX entry parameters {params} != expected {want}")


# entry name -> (the .ptx file it is in, its parameter types, that file's text)
Entries = dict[str, tuple[Path, list[str], str]]


def compile_entries(
    mojo: Path, source_dir: Path, work: Path, *, arch: str, module: str, source: str, what: str
) -> tuple[Entries, float]:
    """Build `source` (a Mojo module named `module` exporting kernel wrappers, importing from
    `source_dir`) for `arch` into PTX under work/asm; returns its entries and the compile
    seconds. RuntimeError with the compiler's last lines when it fails (`what` names it)."""
    entry = work / f"{module}.mojo"
    entry.write_text(source)
    asm = work / "asm"
    asm.mkdir()
    cmd = [
        str(mojo),
        "build",
        "-I",
        str(source_dir),
        f"--target-accelerator={arch}",
        "--emit",
        "asm",
        str(entry),
        "-o",
        str(asm / "host.s"),
    ]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work, check=False)
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(
            f"mojo build of {what} failed (exit {proc.returncode}):\n"
            + build.compiler_output_tail(proc.stderr + proc.stdout)
        )
    found: Entries = {}
    for path in sorted(asm.glob("*.ptx")):
        text = path.read_text()
        for name, params in parse_entries(text).items():
            found[name] = (path, params, text)
    return found, seconds


def pick_entry(found: Entries, prefix: str, arch: str) -> tuple[str, list[str], str]:
    """The one entry whose name starts with `prefix`: (name, params, PTX text), checked to
    target `arch` and to call no external function."""
    matches = [n for n in found if n.startswith(prefix)]
    if len(matches) != 1:
        raise RuntimeError(
            f"expected one PTX entry named {prefix}*, found {matches} among {sorted(found)}"
        )
    name = matches[0]
    path, params, text = found[name]
    if f".target {arch}" not in text:
        raise RuntimeError(f"{path.name} does not target {arch}")
    if re.search(r"\.extern\s+\.func", text):
        raise RuntimeError(f"{path.name} calls external functions")
    return name, params, text
