"""The sm_90 fused kernels: their PTX build and manifest (any machine with mojo, so CPU CI checks
them) and their parity with the torch reference (marked gpu: needs a CUDA GPU and the PTX of this
source in the kernel cache, `MILI_CACHE_DIR=<dir> mili kernels build --gpu` where Mojo is).

GPU tolerances: fp32 within 4e-6 of the output's magnitude (torch's CUDA rsqrt/exp and sum order
differ from ours by an ulp or two), bf16/fp16 within 2e-2.
"""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import build
from kernels.fused import ptx
from kernels.fused.gpu import GpuFusedKernels, _takes_gemv, pack
from kernels.ptx_entry import check_signature, parse_entries
from mili.engine.model.fused_ops import FusedOps, TorchFusedOps
from tests.kernels.test_fused_parity import TOKENS, _randn, _rope_case, _run_rope, assert_close

EPS = 1e-6


@pytest.fixture(scope="session")
def built_fused_ptx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        mojo = build.find_mojo()
    except build.KernelBuildError:
        pytest.skip("no mojo compiler in this environment")
    out = tmp_path_factory.mktemp("fused-ptx") / "sm_90-fused"
    ptx.build_fused_ptx(mojo, build.SOURCE_DIR, out)
    return out


@pytest.mark.slow
def test_build_fused_ptx_manifest(built_fused_ptx: Path) -> None:
    manifest = json.loads((built_fused_ptx / "manifest.json").read_text())
    assert manifest["format"] == ptx.MANIFEST_FORMAT and manifest["arch"] == "sm_90"
    assert manifest["source_key"] == build.source_key()
    seen = {(r["kernel"], r["dtype"], r["head_dim"]): r for r in manifest["kernels"]}
    for kernel in ("add_rms_norm", "qk_norm_rope", "silu_mul", "gemv", "gemv_silu", "gemv_norm"):
        gemv = kernel.startswith("gemv")
        for dtype in ("bfloat16", "float16") if gemv else ("float32", "bfloat16", "float16"):
            for head_dim in (64, 128, 256) if kernel == "qk_norm_rope" else (0,):
                rec = seen.pop((kernel, dtype, head_dim))
                text = (built_fused_ptx / rec["file"]).read_text()
                assert ".target sm_90" in text and ".extern .func" not in text
                entries = parse_entries(text)
                assert list(entries) == [rec["entry"]]  # one self-contained kernel per file
                assert entries[rec["entry"]] == rec["params"]
                check_signature(ptx.SIGNATURES, kernel, rec["params"])
                assert ".local" not in text  # no per-thread arrays spilled to local memory
                assert "griddepcontrol.wait" in text  # grid_order_gpu.mojo
                if kernel == "gemv_norm":  # its rows move through shared memory 16 B at a time
                    rows = ptx.GEMV_MAX_TOKENS * ptx.GEMV_NORM_MAX_FEATURES * 2
                    assert re.search(rf"\.shared \.align 16 \.b8 \S+\[{rows}\]", text), text[:2000]
    assert not seen, f"unexpected manifest records {sorted(seen)}"
    assert sorted(p.name for p in built_fused_ptx.iterdir()) == sorted(
        [*(r["file"] for r in manifest["kernels"]), "manifest.json"]
    )


@pytest.mark.slow
def test_launch_arguments_match_ptx_params(built_fused_ptx: Path) -> None:
    sizes = {".u64": 8, ".b32": 4}
    kinds = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "f32": ctypes.c_float}
    manifest = json.loads((built_fused_ptx / "manifest.json").read_text())
    for rec in manifest["kernels"]:
        signature = ptx.SIGNATURES[rec["kernel"]]
        packed = pack(rec["kernel"], {name: 1 for name, _ in signature})
        assert [ctypes.sizeof(a) for a in packed] == [sizes[p] for p in rec["params"]]
        assert [type(a) for a in packed] == [kinds[kind] for _, kind in signature]


@pytest.mark.slow
def test_ptx_assembles_without_spills(built_fused_ptx: Path, tmp_path: Path) -> None:
    ptxas = shutil.which("ptxas") or (
        "/usr/local/cuda/bin/ptxas" if Path("/usr/local/cuda/bin/ptxas").exists() else None
    )
    if ptxas is None:
        pytest.skip("ptxas not installed")
    manifest = json.loads((built_fused_ptx / "manifest.json").read_text())
    for rec in manifest["kernels"]:
        proc = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", str(built_fused_ptx / rec["file"]), "-o", "/dev/null"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "0 bytes spill stores" in proc.stderr, (rec["file"], proc.stderr[-1000:])
        # static shared memory past 48 KB does not launch (gemv_norm keeps 4 rows there)
        smem = [int(n) for n in re.findall(r"(\d+) bytes smem", proc.stderr)]
        assert max(smem, default=0) <= 48 * 1024, (rec["file"], smem)


def test_pack_rejects_wrong_arguments() -> None:
    with pytest.raises(AssertionError):
        pack("silu_mul", {"out": 0, "gate_up": 0})
    with pytest.raises(ValueError, match="int32"):
        pack("silu_mul", {"out": 0, "gate_up": 0, "intermediate": 2**31})


def test_rejects_cpu_tensors(tmp_path: Path) -> None:
    kernels = GpuFusedKernels(tmp_path)  # nothing is loaded before the device check
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        kernels.silu_mul(torch.zeros(2, 8))
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        kernels.add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(8), EPS)


def test_gemv_takes_decode_batches_of_whole_aligned_rows_only() -> None:
    """Which F.linear calls the gemv kernel computes (the rest go to torch): checked on CPU
    tensors, the predicate looks at shapes, dtypes, strides and alignment only."""
    bf16 = torch.bfloat16
    x, weight = torch.zeros(4, 64, dtype=bf16), torch.zeros(32, 64, dtype=bf16)
    assert _takes_gemv(x, weight, None) and _takes_gemv(x[:1], weight, None)
    assert not _takes_gemv(torch.zeros(5, 64, dtype=bf16), weight, None)  # past 4 rows
    assert not _takes_gemv(x[:0], weight, None)
    assert not _takes_gemv(x, weight, torch.zeros(32, dtype=bf16))  # a bias
    assert not _takes_gemv(x.float(), weight.float(), None)  # fp32
    assert not _takes_gemv(x, weight.half(), None)  # mixed dtypes
    assert not _takes_gemv(x[:, ::2], weight[:, :32], None)  # strided rows
    shifted = torch.zeros(4 * 64 + 4, dtype=bf16)[4:].view(4, 64)  # 8 bytes past alignment
    assert shifted.is_contiguous() and not _takes_gemv(shifted, weight, None)
    short = torch.zeros(4, 60, dtype=bf16)  # rows of 7.5 16-byte vectors
    assert not _takes_gemv(short, torch.zeros(32, 60, dtype=bf16), None)
    assert not _takes_gemv(x, torch.zeros(32, 48, dtype=bf16), None)  # widths differ


# ---- parity on a GPU --------------------------------------------------------------------------


REFERENCE = TorchFusedOps()
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", (64, 100, 1024, 5120))
@pytest.mark.parametrize("rows", TOKENS)
def test_gpu_add_rms_norm(gpu_fused: FusedOps, rows: int, dim: int, dtype: torch.dtype) -> None:
    x = _randn(rows, dim, dtype=dtype, seed=rows).cuda()
    residual = _randn(rows, dim, dtype=dtype, seed=dim).cuda()
    weight = _randn(dim, dtype=dtype, seed=1).cuda()
    assert_close(gpu_fused.rms_norm(x, weight, EPS), REFERENCE.rms_norm(x, weight, EPS))
    expected_residual = residual.clone()
    expected = REFERENCE.add_rms_norm(x.clone(), expected_residual, weight, EPS)
    actual = gpu_fused.add_rms_norm(x.clone(), residual, weight, EPS)
    assert torch.equal(residual, expected_residual)
    assert_close(actual, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("intermediate", (96, 99, 3072))
@pytest.mark.parametrize("rows", TOKENS)
def test_gpu_silu_mul(
    gpu_fused: FusedOps, rows: int, intermediate: int, dtype: torch.dtype
) -> None:
    gate_up = (_randn(rows, 2 * intermediate, dtype=dtype, seed=intermediate) * 4).cuda()
    assert_close(gpu_fused.silu_mul(gate_up), REFERENCE.silu_mul(gate_up))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("ratio", (1, 2, 4, 8))
@pytest.mark.parametrize("tokens", TOKENS)
def test_gpu_qk_norm_rope_kv(
    gpu_fused: FusedOps, tokens: int, ratio: int, head_dim: int, dtype: torch.dtype
) -> None:
    case = {name: t.cuda() for name, t in _rope_case(tokens, ratio, head_dim, dtype).items()}
    expected = _run_rope(REFERENCE, case)
    actual = _run_rope(gpu_fused, case)
    for a, e in zip(actual, expected, strict=True):
        assert_close(a.contiguous(), e.contiguous())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(1, 8), (5, 1032), (1024, 3072), (4099, 1024)]
)
@pytest.mark.parametrize("tokens", range(1, ptx.GEMV_MAX_TOKENS + 1))
def test_gpu_linear_at_decode_batch_sizes(
    gpu_fused: FusedOps, tokens: int, out_features: int, in_features: int, dtype: torch.dtype
) -> None:
    """The gemv kernel (1 to 4 rows): the exact product rounded once, as close as cuBLAS's;
    odd widths (a row of one vector; N not a multiple of the CTA's 4 columns) included."""
    x = _randn(tokens, in_features, dtype=dtype, seed=tokens).cuda()
    weight = (_randn(out_features, in_features, dtype=dtype, seed=out_features)).cuda()
    weight *= in_features**-0.5
    exact = x.double() @ weight.double().T
    out = gpu_fused.linear(x, weight, None)
    assert_close(out, exact.to(dtype))
    cublas = torch.nn.functional.linear(x, weight)
    assert (out.double() - exact).abs().max() <= 2 * (cublas.double() - exact).abs().max() + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize(("out_features", "intermediate"), [(5, 8), (1024, 3072), (1030, 1032)])
@pytest.mark.parametrize("tokens", range(1, ptx.GEMV_MAX_TOKENS + 2))
def test_gpu_silu_mul_linear(
    gpu_fused: FusedOps, tokens: int, out_features: int, intermediate: int, dtype: torch.dtype
) -> None:
    """The down projection with silu(gate) * up made as the gemv reads it (1 to 4 rows; 5 rows
    go through silu_mul and torch's GEMM): silu_mul's rounding, then the exact product rounded
    once, as close as cuBLAS's after silu_mul."""
    gate_up = (_randn(tokens, 2 * intermediate, dtype=dtype, seed=intermediate) * 2).cuda()
    weight = (_randn(out_features, intermediate, dtype=dtype, seed=tokens)).cuda()
    weight *= intermediate**-0.5
    product = REFERENCE.silu_mul(gate_up)  # torch's rounding of silu(gate) * up
    exact = product.double() @ weight.double().T
    out = gpu_fused.silu_mul_linear(gate_up, weight)
    assert_close(out, exact.to(dtype))
    cublas = torch.nn.functional.linear(product, weight)
    assert (out.double() - exact).abs().max() <= 2 * (cublas.double() - exact).abs().max() + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("hidden", (64, 1024, ptx.GEMV_NORM_MAX_FEATURES, 5128))
@pytest.mark.parametrize("with_residual", (True, False))
@pytest.mark.parametrize("tokens", range(1, ptx.GEMV_MAX_TOKENS + 2))
def test_gpu_add_rms_norm_linear(
    gpu_fused: FusedOps, tokens: int, with_residual: bool, hidden: int, dtype: torch.dtype
) -> None:
    """The projection of a normed input with the norm made by the gemv's CTAs (1 to 4 rows,
    hidden up to GEMV_NORM_MAX_FEATURES; 5 rows and a wider hidden take the separate ops): the
    new residual bit for bit torch's sum, the output the reference's within tolerance."""
    x = _randn(tokens, hidden, dtype=dtype, seed=tokens).cuda()
    residual = _randn(tokens, hidden, dtype=dtype, seed=hidden).cuda() if with_residual else None
    norm_weight = (_randn(hidden, dtype=dtype, seed=1) * 0.5 + 1).cuda()
    weight = (_randn(3 * 512 + 8, hidden, dtype=dtype, seed=2) * hidden**-0.5).cuda()
    expected_residual = None if residual is None else residual.clone()
    expected, expected_r = REFERENCE.add_rms_norm_linear(
        x.clone(), expected_residual, norm_weight, EPS, weight, None
    )
    out, r = gpu_fused.add_rms_norm_linear(x.clone(), residual, norm_weight, EPS, weight, None)
    assert torch.equal(r, expected_r)
    assert_close(out, expected)


@pytest.mark.gpu
def test_gpu_linear_leaves_other_shapes_to_torch(gpu_fused: FusedOps) -> None:
    """Past 4 rows, fp32, a bias or a strided x: torch's GEMM itself (bit for bit)."""
    x = _randn(ptx.GEMV_MAX_TOKENS + 1, 64, dtype=torch.bfloat16, seed=0).cuda()
    weight = _randn(32, 64, dtype=torch.bfloat16, seed=1).cuda()
    bias = _randn(32, dtype=torch.bfloat16, seed=2).cuda()
    linear = torch.nn.functional.linear
    assert torch.equal(gpu_fused.linear(x, weight, None), linear(x, weight))
    assert torch.equal(gpu_fused.linear(x[:1], weight, bias), linear(x[:1], weight, bias))
    assert torch.equal(
        gpu_fused.linear(x[:2, ::2], weight[:, :32], None), linear(x[:2, ::2], weight[:, :32])
    )
    x32, w32 = x[:1].float(), weight.float()
    assert torch.equal(gpu_fused.linear(x32, w32, None), linear(x32, w32))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", (1, 17))
def test_overlapped_launches_compute_what_plain_ones_do(gpu_fused: Any, tokens: int) -> None:
    """Kernels launched overlapping the one before (programmatic stream serialization) each
    wait for it first (kernels/mojo/grid_order_gpu.mojo): a chain of 40 layers' norm and
    projection, silu*mul and projection (gemv or not), eager and replayed from a CUDA graph, is
    bit for bit the chain launched plainly (a kernel reading its input early would read the last
    layer's)."""
    hidden, inter, dtype = 1024, 3072, torch.bfloat16
    norm_weight = _randn(hidden, dtype=dtype, seed=3).cuda()
    up = (_randn(2 * inter, hidden, dtype=dtype, seed=4) * hidden**-0.5).cuda()
    down = (_randn(hidden, inter, dtype=dtype, seed=5) * inter**-0.5).cuda()
    x0 = _randn(tokens, hidden, dtype=dtype, seed=6).cuda()

    def chain() -> torch.Tensor:
        x, residual = x0.clone(), torch.zeros_like(x0)
        for _ in range(40):
            gate_up, residual = gpu_fused.add_rms_norm_linear(
                x, residual, norm_weight, EPS, up, None
            )
            x = gpu_fused.silu_mul_linear(gate_up, down)
        return x + residual

    plain = chain()
    gpu_fused.overlap_launches = True
    try:
        eager = chain()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = chain()
        graph.replay()
        torch.cuda.synchronize()
    finally:
        gpu_fused.overlap_launches = False
    assert torch.isfinite(plain).all()
    assert torch.equal(eager, plain) and torch.equal(captured, plain)


@pytest.mark.gpu
def test_without_the_gemv_linear_is_torchs(gpu_fused: Any) -> None:
    kernels = GpuFusedKernels(gpu_fused.kernel_dir)
    assert kernels.fall_back("fused.linear")
    x = _randn(1, 1024, dtype=torch.bfloat16, seed=0).cuda()
    weight = _randn(512, 1024, dtype=torch.bfloat16, seed=1).cuda()
    assert torch.equal(kernels.linear(x, weight, None), torch.nn.functional.linear(x, weight))
    gate_up = _randn(1, 2048, dtype=torch.bfloat16, seed=2).cuda()
    down = _randn(512, 1024, dtype=torch.bfloat16, seed=3).cuda()
    expected = torch.nn.functional.linear(kernels.silu_mul(gate_up), down)
    assert torch.equal(kernels.silu_mul_linear(gate_up, down), expected)
    residual, norm_weight = x.clone() * 0.5, torch.ones(1024, dtype=torch.bfloat16).cuda()
    expected_residual = residual.clone()
    h = kernels.add_rms_norm(x.clone(), expected_residual, norm_weight, EPS)
    y, r = kernels.add_rms_norm_linear(x.clone(), residual, norm_weight, EPS, weight, None)
    assert torch.equal(y, torch.nn.functional.linear(h, weight))
    assert torch.equal(r, expected_residual)
