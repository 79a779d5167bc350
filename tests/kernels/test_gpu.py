"""GPU (sm_90) attention kernels: the PTX build (any machine with mojo) and parity (needs a GPU).

The build test runs on every CI machine: it compiles every (kernel, dtype, head_dim) to PTX with
`kernels.ptx.build_ptx` and checks the manifest, each file's target and entry, the entry's
parameters against what `kernels.gpu` passes, and (where `ptxas` is installed) that the PTX
assembles for sm_90a without spills within the static shared-memory limit.

The GPU parity grid lives in test_parity.py; it and the stream test here need a CUDA GPU and
load the PTX of this source from the kernel cache (`MILI_CACHE_DIR=<dir> mili kernels build
--gpu` on a machine with the toolchain, then carry <dir> and set MILI_CACHE_DIR to it on the GPU
host), or build it there when mojo is installed.
"""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kernels import build, ptx
from kernels.gpu import GpuKernels, _pack
from tests.kernels.cases import (
    assert_close,
    make_case,
    reference_decode,
    run_decode,
    run_prefill,
)

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIR = ROOT / "kernels" / "mojo"
STATIC_SHARED_LIMIT = 48 * 1024


def _mojo() -> Path | None:
    try:
        return build.find_mojo()
    except build.KernelBuildError:
        return None


@pytest.fixture(scope="session")
def built_ptx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    mojo = _mojo()
    if mojo is None:
        pytest.skip("no mojo compiler in this environment")
    out = tmp_path_factory.mktemp("ptx") / "kernels"
    ptx.build_ptx(mojo, SOURCE_DIR, out)
    return out


@pytest.mark.slow
def test_build_ptx_manifest(built_ptx: Path) -> None:
    manifest = json.loads((built_ptx / "manifest.json").read_text())
    assert manifest["format"] == ptx.MANIFEST_FORMAT
    assert manifest["arch"] == "sm_90"
    seen = {(r["kernel"], r["dtype"], r["head_dim"]): r for r in manifest["kernels"]}
    for kernel in ("prefill", "decode", "decode_combine"):
        for dtype in ("float32", "bfloat16", "float16"):
            for head_dim in (64, 128, 256):
                rec = seen.pop((kernel, dtype, head_dim))
                assert rec["file"] == f"{kernel}_{dtype}_{head_dim}.ptx"
                text = (built_ptx / rec["file"]).read_text()
                assert ".target sm_90" in text
                assert f".visible .entry {rec['entry']}(" in text
                entries = ptx.parse_entries(text)
                assert list(entries) == [rec["entry"]]  # one self-contained kernel per file
                assert entries[rec["entry"]] == rec["params"]
                ptx.check_signature(kernel, rec["params"])
                assert ".extern .func" not in text
                assert rec["shared_bytes"] <= STATIC_SHARED_LIMIT
    assert not seen, f"unexpected manifest records {sorted(seen)}"
    # No stray build files next to the published ones.
    assert sorted(p.name for p in built_ptx.iterdir()) == sorted(
        [*(r["file"] for r in manifest["kernels"]), "manifest.json"]
    )


@pytest.mark.slow
def test_launch_arguments_match_ptx_params(built_ptx: Path) -> None:
    """The ctypes the loader packs have the sizes of the PTX entry parameters, in order."""
    sizes = {".u64": 8, ".b32": 4}
    manifest = json.loads((built_ptx / "manifest.json").read_text())
    for rec in manifest["kernels"]:
        values = {
            name: (1.0 if kind == "f32" else 1) for name, kind in ptx.SIGNATURES[rec["kernel"]]
        }
        packed = _pack(rec["kernel"], values)
        assert [ctypes.sizeof(a) for a in packed] == [sizes[p] for p in rec["params"]]
        # pointers are 64-bit unsigned, scalars 32-bit; float params are really floats
        for (_, kind), arg in zip(ptx.SIGNATURES[rec["kernel"]], packed, strict=True):
            want = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "f32": ctypes.c_float}[kind]
            assert type(arg) is want


@pytest.mark.slow
def test_ptx_assembles_without_spills(built_ptx: Path, tmp_path: Path) -> None:
    ptxas = shutil.which("ptxas") or (
        "/usr/local/cuda/bin/ptxas" if Path("/usr/local/cuda/bin/ptxas").exists() else None
    )
    if ptxas is None:
        pytest.skip("ptxas not installed")
    manifest = json.loads((built_ptx / "manifest.json").read_text())
    for rec in manifest["kernels"]:
        proc = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", str(built_ptx / rec["file"]), "-o", str(tmp_path / "k")],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "0 bytes spill stores" in proc.stderr, (rec["file"], proc.stderr[-1000:])


def test_build_failure_reports_compiler_stderr(tmp_path: Path) -> None:
    mojo = _mojo()
    if mojo is None:
        pytest.skip("no mojo compiler in this environment")
    src = tmp_path / "src"
    src.mkdir()
    (src / "prefill_gpu.mojo").write_text("def broken(\n")
    (src / "decode_gpu.mojo").write_text("")
    with pytest.raises(RuntimeError, match="mojo build of the GPU kernels failed") as info:
        ptx.build_ptx(mojo, src, tmp_path / "out")
    assert "Crashpad" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_pack_rejects_wrong_arguments() -> None:
    with pytest.raises(AssertionError):
        _pack("decode_combine", {"out": 0, "part_o": 0, "part_lse": 0})
    with pytest.raises(ValueError, match="int32"):
        _pack("decode_combine", {"out": 0, "part_o": 0, "part_lse": 0, "num_splits": 2**31})


def test_rejects_cpu_tensors(tmp_path: Path) -> None:
    case = make_case(
        [3], [0], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32
    )
    kernels = GpuKernels(tmp_path)
    with pytest.raises(ValueError, match="CUDA"):
        run_prefill(kernels, case)
    with pytest.raises(ValueError, match="CUDA"):
        run_decode(kernels, case)


# ---- on a GPU -------------------------------------------------------------------------------
# The parity grid itself runs on the GPU kernels in test_parity.py (fixture `device_kernels`).


@pytest.mark.gpu
def test_launches_on_the_current_stream(gpu_kernels) -> None:
    """Launches go on torch's current stream (a side stream here) and results are right."""
    case = make_case(
        [1, 1],
        [99, 4],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
    )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = run_decode(gpu_kernels, case)
    stream.synchronize()
    assert_close(out, reference_decode(case), torch.bfloat16)
