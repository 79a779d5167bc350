"""Ahead-of-time PTX build of the GPU attention kernels (kernels/mojo/*_gpu.mojo).

`build_ptx` generates a small Mojo entry module with one named wrapper per specialisation
(kernel x dtype x head_dim), compiles it with `mojo build --target-accelerator=sm_90 --emit asm`
(which writes one self-contained PTX file per kernel, with hash-suffixed `.visible .entry`
names), finds each wrapper's PTX by its entry name, checks the entry's parameter list against
`SIGNATURES`, and writes

    out_dir/<kernel>_<dtype>_<head_dim>.ptx
    out_dir/manifest.json

Kernels: `prefill`, `decode`, `decode_combine` (CUDA cores, every dtype; fp32 runs on them) and the
tensor-core / FlashInfer-style `flash_prefill` and `paged_decode_g<GC>` (bf16/fp16 only; GC query
heads per CTA, a compile-time parameter). The latter take dynamic shared memory beyond the 48 KB
default: the manifest carries each kernel's `dynamic_shared_bytes` and the loader raises the
function's limit to it. Where `ptxas` is installed the build also assembles every PTX file for
sm_90a and records its registers, spills and shared memory (`ptxas` in each record).

`build_gpu` does that once per source into the kernel cache (kernels/build.py: its directory,
lock and staging), as kernels/fused/ptx.py's `build_fused_gpu` does for the fused ops; build.py
knows nothing of PTX, so the two modules import in one direction.

The GPU host needs no Mojo toolchain: `kernels.gpu.GpuKernels` loads the PTX through the CUDA
driver (which JIT-compiles it to SASS) and launches it with the parameters listed here.

The module has no torch import so a CI job can build and check the PTX on a machine without a GPU.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kernels import build
from mili.engine.kv.kv_layout import DTYPES  # one specialisation per dtype a service may run

_LOG = logging.getLogger("mili.kernels")

HEAD_DIMS = (64, 128, 256)
DECODE_GROUP_SIZES = (1, 2, 4, 8)  # GC of paged_decode_g<GC>: query heads one CTA serves
KERNELS = (
    "prefill",
    "decode",
    "decode_combine",
    "flash_prefill",
    *(f"paged_decode_g{gc}" for gc in DECODE_GROUP_SIZES),
)
# Where spills cost the most: a build whose ptxas reports a spill here fails the CI check.
TENSOR_CORE_DTYPES = ("bfloat16", "float16")
MANIFEST_FORMAT = 2

# Mojo spelling of each dtype.
_MOJO_DTYPE = {"float32": "DType.float32", "bfloat16": "DType.bfloat16", "float16": "DType.float16"}

# Kernel parameter lists, in order: "ptr" (a device pointer, .u64 in PTX), "i32", "f32"
# (both .b32). kernels/gpu.py packs its launch arguments from these; build_ptx checks every
# compiled entry against them, so the loader and the PTX cannot drift apart silently.
SIGNATURES: dict[str, tuple[tuple[str, str], ...]] = {
    "prefill": (
        ("out", "ptr"),
        ("q", "ptr"),
        ("k_cache", "ptr"),
        ("v_cache", "ptr"),
        ("cu_seqlens", "ptr"),
        ("start_positions", "ptr"),
        ("block_tables", "ptr"),
        ("num_q_heads", "i32"),
        ("num_kv_heads", "i32"),
        ("block_size", "i32"),
        ("max_blocks", "i32"),
        ("scale_log2", "f32"),
    ),
    "decode": (
        ("out", "ptr"),
        ("part_o", "ptr"),
        ("part_lse", "ptr"),
        ("q", "ptr"),
        ("k_cache", "ptr"),
        ("v_cache", "ptr"),
        ("block_tables", "ptr"),
        ("seq_lens", "ptr"),
        ("num_q_heads", "i32"),
        ("num_kv_heads", "i32"),
        ("block_size", "i32"),
        ("max_blocks", "i32"),
        ("num_splits", "i32"),
        ("scale_log2", "f32"),
    ),
    "decode_combine": (
        ("out", "ptr"),
        ("part_o", "ptr"),
        ("part_lse", "ptr"),
        ("num_splits", "i32"),
    ),
}
SIGNATURES["flash_prefill"] = SIGNATURES["prefill"]
for _gc in DECODE_GROUP_SIZES:
    SIGNATURES[f"paged_decode_g{_gc}"] = SIGNATURES["decode"]
PTX_PARAM_TYPE = {"ptr": ".u64", "i32": ".b32", "f32": ".b32"}
_MOJO_PARAM_TYPE = {"i32": "Int32", "f32": "Float32"}

# Launch geometry, asserted against the Mojo sources at compile time (see _entry_source).
THREADS = 128  # prefill and decode CTAs
PREFILL_BLOCK_M = {64: 16, 128: 16, 256: 8}  # query rows per prefill CTA: grid.x = ceil(T / BM)
DECODE_HEADS_PER_CTA = 8  # grid.y = KVH * ceil((H / KVH) / 8)
FLASH_PREFILL_BLOCK_M = 64  # rows (token x head of one kv group) per flash_prefill CTA
PAGED_DECODE_MIN_SPLIT_KEYS = 64  # paged_decode never cuts a split shorter than this
_PAD = 8  # flash_prefill's shared-memory row padding (elements)
_PAGED_DECODE_STAGES = 3
_PAGED_DECODE_KEYS_PER_GROUP = 4
_PAGED_DECODE_IDS_WINDOW = 512


def kernel_dtypes(kernel: str) -> tuple[str, ...]:
    """The dtypes a kernel is built for: tensor-core kernels take 2-byte inputs only."""
    return DTYPES if kernel in ("prefill", "decode", "decode_combine") else TENSOR_CORE_DTYPES


def dynamic_shared_bytes(kernel: str, head_dim: int) -> int:
    """Dynamic shared memory a launch of `kernel` needs (2-byte dtypes), mirrored from the Mojo
    sources and asserted against them at compile time (see _entry_source)."""
    if kernel == "flash_prefill":  # Qs [BM][D + 8], 2 x (Ks, Vs) [BN][D + 8], Rb [2][BN] int64
        block_n = 32 if head_dim == 256 else 64
        rows = FLASH_PREFILL_BLOCK_M + 4 * block_n
        return rows * (head_dim + _PAD) * 2 + 2 * block_n * 8
    if kernel.startswith("paged_decode"):  # K/V ring [STAGES][2][TK][D], block ids [512] int32
        keys_per_tile = (THREADS // (head_dim // 8)) * _PAGED_DECODE_KEYS_PER_GROUP
        ring = _PAGED_DECODE_STAGES * 2 * keys_per_tile * head_dim * 2
        return ring + _PAGED_DECODE_IDS_WINDOW * 4
    return 0  # static shared memory only


_SOURCES = (
    "prefill_gpu.mojo",
    "decode_gpu.mojo",
    "flash_prefill_gpu.mojo",
    "paged_decode_gpu.mojo",
)
_ENTRY_MODULE = "mk"


# The compiler keeps only about the first 30 characters of a kernel's name in its PTX entry
# name (then a mangled tail and a hash), so the wrappers have short, prefix-free names.
_SHORT_KERNEL = {
    "prefill": "pf",
    "decode": "dc",
    "decode_combine": "cb",
    "flash_prefill": "fa",
    **{f"paged_decode_g{gc}": f"pd{gc}" for gc in DECODE_GROUP_SIZES},
}
_SHORT_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def wrapper_name(kernel: str, dtype: str, head_dim: int) -> str:
    return f"{_SHORT_KERNEL[kernel]}_{_SHORT_DTYPE[dtype]}_d{head_dim}_"


def _pointer_type(kind: str, name: str, dtype: str) -> str:
    if name in ("part_o", "part_lse"):
        return "Pointer[Float32, MutAnyOrigin]"
    if name in ("cu_seqlens", "start_positions", "block_tables", "seq_lens"):
        return "Pointer[Int32, MutAnyOrigin]"
    return f"Pointer[Scalar[{_MOJO_DTYPE[dtype]}], MutAnyOrigin]"


def _entry_source() -> str:
    """Mojo module with one monomorphic, uniquely named wrapper per specialisation."""
    lines = [
        "# Generated by kernels/ptx.py: one named entry per (kernel, dtype, head_dim).",
        "from max.gpu.host import DeviceContext",
        "from prefill_gpu import prefill_kernel, prefill_block_m, PREFILL_THREADS",
        "from decode_gpu import decode_kernel, decode_combine_kernel, DECODE_THREADS, GM",
        "from flash_prefill_gpu import flash_prefill_kernel, flash_prefill_block_m",
        "from flash_prefill_gpu import flash_prefill_smem_bytes, FLASH_PREFILL_THREADS",
        "from paged_decode_gpu import paged_decode_kernel, paged_decode_smem_bytes",
        "from paged_decode_gpu import PAGED_DECODE_THREADS, MIN_SPLIT_KEYS",
        "",
    ]
    generic = {
        "prefill": "prefill_kernel",
        "decode": "decode_kernel",
        "decode_combine": "decode_combine_kernel",
        "flash_prefill": "flash_prefill_kernel",
    }
    names = []
    for kernel in KERNELS:
        for dtype in kernel_dtypes(kernel):
            for head_dim in HEAD_DIMS:
                name = wrapper_name(kernel, dtype, head_dim)
                names.append(name)
                params = []
                for pname, kind in SIGNATURES[kernel]:
                    ptype = (
                        _pointer_type(kind, pname, dtype)
                        if kind == "ptr"
                        else _MOJO_PARAM_TYPE[kind]
                    )
                    params.append(f"    {pname}_: {ptype},")
                args = ", ".join(f"{pname}_" for pname, _ in SIGNATURES[kernel])
                lines += [f"def {name}(", *params, "):"]
                if kernel == "prefill":
                    lines += [
                        f"    comptime assert prefill_block_m({head_dim}) == "
                        f'{PREFILL_BLOCK_M[head_dim]}, "kernels/ptx.py PREFILL_BLOCK_M is stale"',
                        f'    comptime assert PREFILL_THREADS == {THREADS}, "THREADS is stale"',
                    ]
                elif kernel == "decode":
                    lines += [
                        f'    comptime assert GM == {DECODE_HEADS_PER_CTA}, "heads per CTA stale"',
                        f'    comptime assert DECODE_THREADS == {THREADS}, "THREADS is stale"',
                    ]
                elif kernel == "flash_prefill":
                    smem = dynamic_shared_bytes(kernel, head_dim)
                    lines += [
                        f"    comptime assert flash_prefill_block_m({head_dim}) == "
                        f'{FLASH_PREFILL_BLOCK_M}, "kernels/ptx.py FLASH_PREFILL_BLOCK_M is stale"',
                        f"    comptime assert flash_prefill_smem_bytes({head_dim}) == {smem}, "
                        '"kernels/ptx.py dynamic_shared_bytes is stale"',
                        f'    comptime assert FLASH_PREFILL_THREADS == {THREADS}, "THREADS stale"',
                    ]
                elif kernel.startswith("paged_decode_g"):
                    smem = dynamic_shared_bytes(kernel, head_dim)
                    lines += [
                        f"    comptime assert paged_decode_smem_bytes({head_dim}) == {smem}, "
                        '"kernels/ptx.py dynamic_shared_bytes is stale"',
                        f"    comptime assert MIN_SPLIT_KEYS == {PAGED_DECODE_MIN_SPLIT_KEYS}, "
                        '"kernels/ptx.py PAGED_DECODE_MIN_SPLIT_KEYS is stale"',
                        f'    comptime assert PAGED_DECODE_THREADS == {THREADS}, "THREADS stale"',
                    ]
                if kernel.startswith("paged_decode_g"):
                    gc = int(kernel.removeprefix("paged_decode_g"))
                    call = f"paged_decode_kernel[{_MOJO_DTYPE[dtype]}, {head_dim}, {gc}]"
                else:
                    call = f"{generic[kernel]}[{_MOJO_DTYPE[dtype]}, {head_dim}]"
                lines += [f"    {call}({args})", ""]
    lines += ["", "def main() raises:", "    var ctx = DeviceContext()"]
    lines += [f"    _ = ctx.compile_function[{name}]()" for name in names]
    return "\n".join(lines) + "\n"


_ENTRY_RE = re.compile(r"\.visible\s+\.entry\s+([A-Za-z0-9_$]+)\s*\(([^)]*)\)", re.S)
_PARAM_RE = re.compile(r"\.param\s+(\.[a-z0-9]+)")


def parse_entries(ptx: str) -> dict[str, list[str]]:
    """`.visible .entry` names of a PTX text -> their parameter types (".u64", ".b32", ...)."""
    return {m.group(1): _PARAM_RE.findall(m.group(2)) for m in _ENTRY_RE.finditer(ptx)}


def check_signature(kernel: str, params: list[str]) -> None:
    want = [PTX_PARAM_TYPE[kind] for _, kind in SIGNATURES[kernel]]
    if params != want:
        raise RuntimeError(f"{kernel}: PTX entry parameters {params} != expected {want}")


def _static_shared_bytes(ptx: str) -> int:
    return sum(int(n) for n in re.findall(r"\.shared\s+\.align\s+\d+\s+\.b8\s+\S+\[(\d+)\]", ptx))


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


def build_ptx(mojo: Path, source_dir: Path, out_dir: Path, *, arch: str = "sm_90") -> dict:
    """Compile every (kernel, dtype, head_dim) to out_dir/<kernel>_<dtype>_<head_dim>.ptx.

    Returns the manifest (also written to out_dir/manifest.json, last, atomically):
    {"format", "arch", "source_key", "compile_seconds", "threads", "prefill_block_m",
     "decode_heads_per_cta", "flash_prefill_block_m", "paged_decode_min_split_keys", "ptxas",
     "signatures", "kernels": [{"kernel", "dtype", "head_dim", "file", "entry", "params",
     "shared_bytes", "dynamic_shared_bytes", "ptxas"?}, ...]}; each record's "ptxas" (present
    when an assembler was found) is ptxas_info's dict.
    """
    source_dir, out_dir = Path(source_dir).resolve(), Path(out_dir).resolve()
    mojo = Path(mojo) if Path(mojo).parent == Path() else Path(mojo).resolve()  # bare name: PATH
    for name in _SOURCES:
        if not (source_dir / name).is_file():
            raise FileNotFoundError(f"{source_dir / name} not found")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.build-", dir=out_dir.parent))
    try:
        found, seconds = compile_entries(
            mojo,
            source_dir,
            work,
            arch=arch,
            module=_ENTRY_MODULE,
            source=_entry_source(),
            what="the GPU kernels",
        )
        final = work / "final"
        final.mkdir()
        records: list[dict[str, Any]] = []
        for kernel in KERNELS:
            for dtype in kernel_dtypes(kernel):
                for head_dim in HEAD_DIMS:
                    prefix = f"{_ENTRY_MODULE}_{wrapper_name(kernel, dtype, head_dim)}"
                    name, params, text = pick_entry(found, prefix, arch)
                    check_signature(kernel, params)
                    file = f"{kernel}_{dtype}_{head_dim}.ptx"
                    (final / file).write_text(text)
                    records.append(
                        {
                            "kernel": kernel,
                            "dtype": dtype,
                            "head_dim": head_dim,
                            "file": file,
                            "entry": name,
                            "params": params,
                            "shared_bytes": _static_shared_bytes(text),
                            "dynamic_shared_bytes": dynamic_shared_bytes(kernel, head_dim),
                        }
                    )
        assembler = find_ptxas()
        if assembler is not None:  # one ptxas process per file, as many at once as CPUs
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                infos = pool.map(
                    lambda rec: ptxas_info(assembler, final / rec["file"], arch), records
                )
                for rec, info in zip(records, infos, strict=True):
                    rec["ptxas"] = info
        manifest = {
            "format": MANIFEST_FORMAT,
            "arch": arch,
            "source_key": build.source_key(source_dir),
            "compile_seconds": round(seconds, 2),
            "threads": THREADS,
            "prefill_block_m": {str(k): v for k, v in PREFILL_BLOCK_M.items()},
            "decode_heads_per_cta": DECODE_HEADS_PER_CTA,
            "flash_prefill_block_m": FLASH_PREFILL_BLOCK_M,
            "paged_decode_min_split_keys": PAGED_DECODE_MIN_SPLIT_KEYS,
            "ptxas": None if assembler is None else str(assembler),
            "signatures": {k: [list(p) for p in v] for k, v in SIGNATURES.items()},
            "kernels": records,
        }
        (final / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        _publish(final, out_dir)
        return manifest
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _publish(final: Path, out_dir: Path) -> None:
    """Move the built files into out_dir: the whole directory at once when it does not exist,
    else file by file with os.replace (each atomic), the manifest last."""
    if not out_dir.exists():
        try:
            os.rename(final, out_dir)
            return
        except OSError:
            pass  # created concurrently: fall through to per-file replacement
    out_dir.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in final.iterdir() if p.name != "manifest.json")
    for path in [*files, final / "manifest.json"]:
        tmp = out_dir / f".{path.name}.{os.getpid()}.tmp"
        shutil.copyfile(path, tmp)
        os.replace(tmp, out_dir / path.name)


def load_manifest(kernel_dir: Path) -> dict:
    path = Path(kernel_dir) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: build it with "
            "`mili kernels build --gpu` on a machine with the Mojo toolchain"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != MANIFEST_FORMAT:
        raise RuntimeError(
            f"{path}: manifest format {manifest.get('format')}, "
            f"expected {MANIFEST_FORMAT}; rebuild the PTX"
        )
    return manifest


def build_gpu(
    root: Path | None = None,
    *,
    mojo: Path | None = None,
    arch: str = build.GPU_ARCH,
    source_dir: Path = build.SOURCE_DIR,
) -> Path:
    """The directory of PTX files and manifest.json for `arch`, compiling them if missing."""
    mojo = build.find_mojo() if mojo is None else mojo
    target = build.gpu_kernel_dir(root, arch, source_dir)
    if (target / "manifest.json").exists():
        return target
    with build._locked(target.parent):
        if (target / "manifest.json").exists():
            return target
        _LOG.info("compiling Mojo GPU attention kernels (%s PTX) into %s", arch, target)
        started = time.monotonic()
        with build._staging(target) as staging:
            try:
                build_ptx(mojo, source_dir, staging, arch=arch)
            except RuntimeError as exc:
                raise build.KernelBuildError(f"building the {arch} kernels failed: {exc}") from exc
        _LOG.info("compiled %s attention kernels in %.1f s", arch, time.monotonic() - started)
    return target
