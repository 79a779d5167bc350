"""GPU (sm_90) attention kernels: the PTX build (any machine with mojo) and parity (needs a GPU).

The build test runs on every CI machine: it compiles every (kernel, dtype, head_dim) to PTX with
`kernels.ptx.build_ptx` and checks the manifest, each file's target and entry, the entry's
parameters against what `kernels.gpu` passes, and (where `ptxas` is installed) that the PTX
assembles for sm_90a without spills within the static shared-memory limit.

The parity tests need a CUDA GPU. They load the PTX of this source from the kernel cache
(`MILI_CACHE_DIR=<dir> mili kernels build --gpu` on a machine with the toolchain, then carry
<dir> and set MILI_CACHE_DIR to it on the GPU host), or build it there when mojo is installed.
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
from tests.kernels.cases import assert_close, make_case, reference_decode, reference_prefill

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
        kernels.prefill(
            case.q,
            case.k_cache,
            case.v_cache,
            case.cu_seqlens,
            case.start_positions,
            case.block_tables,
            scale=case.scale,
        )


# ---- GPU parity ---------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> GpuKernels:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kernel_dir = build.gpu_kernel_dir()
    if not (kernel_dir / "manifest.json").exists():
        if _mojo() is None:
            pytest.skip(
                f"no PTX at {kernel_dir} and no mojo compiler here: build it elsewhere with "
                "`MILI_CACHE_DIR=<dir> mili kernels build --gpu` and set MILI_CACHE_DIR=<dir>"
            )
        kernel_dir = build.build_gpu()
    return GpuKernels(kernel_dir)


LENGTHS = (1, 7, 16, 17, 100, 513)
RATIOS = (1, 2, 4, 8)
DTYPES = (torch.bfloat16, torch.float32)


def _heads(ratio: int) -> tuple[int, int]:
    return 2 * ratio, 2  # (q heads, kv heads)


def _prefill(kernels: GpuKernels, case) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return kernels.prefill(
        case.q,
        case.k_cache,
        case.v_cache,
        case.cu_seqlens,
        case.start_positions,
        case.block_tables,
        scale=case.scale,
    )


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("block_size", (16, 32))
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_parity(
    kernels: GpuKernels,
    length: int,
    ratio: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
) -> None:
    heads, kv_heads = _heads(ratio)
    case = make_case(
        [length],
        [0],
        num_q_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
        seed=length * 7 + ratio,
    )
    assert_close(_prefill(kernels, case), reference_prefill(case), dtype)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("block_size", (16, 32))
@pytest.mark.parametrize("ratio", RATIOS)
def test_prefill_mixed_batch_chunked(
    kernels: GpuKernels, ratio: int, block_size: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Mixed lengths in one packed batch, some continuing a cached prefix (start > 0)."""
    heads, kv_heads = _heads(ratio)
    case = make_case(
        [1, 7, 16, 17, 100, 513, 3],
        [0, 5, 16, 0, 37, 200, 1000],
        num_q_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
        seed=ratio + block_size,
    )
    assert_close(_prefill(kernels, case), reference_prefill(case), dtype)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_prefill_all_specialisations(
    kernels: GpuKernels, head_dim: int, dtype: torch.dtype
) -> None:
    case = make_case(
        [33, 1, 70],
        [0, 40, 9],
        num_q_heads=12,
        num_kv_heads=4,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device="cuda",
        seed=head_dim,
    )
    assert_close(_prefill(kernels, case), reference_prefill(case), dtype)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", (0, 1, 3))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("block_size", (16, 32))
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("length", LENGTHS)
def test_decode_parity(
    kernels: GpuKernels,
    length: int,
    ratio: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    num_splits: int,
) -> None:
    heads, kv_heads = _heads(ratio)
    # A mixed batch: this length plus a few others, each a single new (cached) token.
    contexts = [length, 1, 17, 300]
    case = make_case(
        [1] * len(contexts),
        [c - 1 for c in contexts],
        num_q_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
        seed=length + ratio,
    )
    out = kernels.decode(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        scale=case.scale,
        num_splits=num_splits,
    )
    assert_close(out, reference_decode(case), dtype)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("heads", ((16, 1), (40, 8), (6, 2)))
def test_decode_all_specialisations(
    kernels: GpuKernels, head_dim: int, dtype: torch.dtype, heads: tuple[int, int]
) -> None:
    """Every dtype/head_dim, and q/kv ratios above 8 (16: two CTAs per kv head) and odd (5, 3)."""
    contexts = [1, 64, 1000]
    case = make_case(
        [1] * len(contexts),
        [c - 1 for c in contexts],
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device="cuda",
        seed=head_dim + heads[0],
    )
    for splits in (0, 1, 7):
        out = kernels.decode(
            case.q,
            case.k_cache,
            case.v_cache,
            case.block_tables,
            case.seq_lens,
            scale=case.scale,
            num_splits=splits,
        )
        assert_close(out, reference_decode(case), dtype)


@gpu
@pytest.mark.gpu
def test_no_host_sync_and_current_stream(kernels: GpuKernels) -> None:
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
        out = kernels.decode(
            case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale=case.scale
        )
    stream.synchronize()
    assert_close(out, reference_decode(case), torch.bfloat16)
