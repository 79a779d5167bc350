"""GPU (sm_90) attention kernels: the PTX build (any machine with mojo) and parity (needs a GPU).

The build test runs on every CI machine: it compiles every (kernel, dtype, head_dim) to PTX with
`kernels.ptx.build_ptx` and checks the manifest, each file's target and entry, the entry's
parameters against what `kernels.gpu` passes (`kernels.signatures`), and (where `ptxas` is
installed) that the PTX assembles for sm_90a without spills within the static shared-memory limit.

The GPU parity grid lives in test_parity.py; it and the stream test here need a CUDA GPU and
load the PTX of this source from the kernel cache (`MILI_CACHE_DIR=<dir> mili kernels build
--gpu` on a machine with the toolchain, then carry <dir> and set MILI_CACHE_DIR to it on the GPU
host), or build it there when mojo is installed.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
from pathlib import Path

import pytest
import torch

from kernels import build, ptx
from kernels.fused import ptx as fused_ptx
from kernels.geometry import (
    PAGED_DECODE_MIN_SPLIT_KEYS,
    dynamic_shared_bytes,
    flash_prefill_min_ctas,
)
from kernels.gpu import GpuKernels, _pack
from kernels.manifest import load_manifest
from kernels.ptx_entry import check_signature, parse_entries
from kernels.ptxas import find_ptxas, parse_ptxas
from kernels.signatures import KERNELS, SIGNATURES
from mili.engine.kv.kv_layout import DTYPES
from tests.kernels.cases import (
    PagedCase,
    assert_close,
    make_case,
    reference_decode,
    reference_prefill,
    run_decode,
    run_prefill,
)

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIR = ROOT / "kernels" / "mojo"
STATIC_SHARED_LIMIT = 48 * 1024
SM90_DYNAMIC_SHARED_LIMIT = 227 * 1024  # per block, opt-in (cuFuncSetAttribute)


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
    tensor_core = (
        "flash_prefill",
        "flash_prefill_3cta",
        *(f"paged_decode_g{gc}" for gc in (1, 2, 4, 8)),
    )
    for kernel in ("prefill", "decode", "decode_combine", *tensor_core):
        dtypes = ("bfloat16", "float16") if kernel in tensor_core else DTYPES
        for dtype in dtypes:
            for head_dim in (64, 128, 256):
                rec = seen.pop((kernel, dtype, head_dim))
                assert rec["file"] == f"{kernel}_{dtype}_{head_dim}.ptx"
                text = (built_ptx / rec["file"]).read_text()
                assert ".target sm_90" in text
                assert f".visible .entry {rec['entry']}(" in text
                entries = parse_entries(text)
                assert list(entries) == [rec["entry"]]  # one self-contained kernel per file
                assert entries[rec["entry"]] == rec["params"]
                check_signature(SIGNATURES, kernel, rec["params"])
                assert ".extern .func" not in text
                # grid_order_gpu.mojo: every kernel may be launched overlapping the previous one
                assert "griddepcontrol.wait" in text and "griddepcontrol.launch_dependents" in text
                assert rec["shared_bytes"] <= STATIC_SHARED_LIMIT
                dynamic = rec["dynamic_shared_bytes"]
                assert dynamic == dynamic_shared_bytes(kernel, head_dim)
                assert (dynamic > 0) == (kernel in tensor_core)
                assert rec["shared_bytes"] + dynamic <= SM90_DYNAMIC_SHARED_LIMIT
                if kernel in tensor_core:  # the whole point of them: tensor cores, async copies
                    assert "cp.async.cg.shared.global" in text
                    assert ".extern .shared" in text  # dynamic shared memory
                if kernel.startswith("flash_prefill"):
                    assert "mma.sync.aligned.m16n8k16.row.col.f32" in text
                    assert "ldmatrix.sync.aligned" in text and ".trans" in text
                # the narrow variant's launch bounds: ptxas sizes its registers for them
                bounds = kernel == "flash_prefill_3cta"
                assert (".maxntid 128" in text) == bounds, rec["file"]
                assert (f".minnctapersm {flash_prefill_min_ctas(head_dim)}" in text) == bounds
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
        values = {name: (1.0 if kind == "f32" else 1) for name, kind in SIGNATURES[rec["kernel"]]}
        packed = _pack(rec["kernel"], values)
        assert [ctypes.sizeof(a) for a in packed] == [sizes[p] for p in rec["params"]]
        # pointers are 64-bit unsigned, scalars 32-bit; float params are really floats
        for (_, kind), arg in zip(SIGNATURES[rec["kernel"]], packed, strict=True):
            want = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "f32": ctypes.c_float}[kind]
            assert type(arg) is want


@pytest.mark.slow
def test_ptx_assembles_without_spills(built_ptx: Path, tmp_path: Path) -> None:
    """Where ptxas exists the build assembled every kernel for sm_90a and recorded its registers,
    spills and shared memory (`ptxas -v`) in the manifest; none may spill, the hot tensor-core
    kernels above all. A few files are assembled again here to check what was recorded."""
    ptxas = find_ptxas()
    if ptxas is None:
        pytest.skip("ptxas not installed")
    manifest = json.loads((built_ptx / "manifest.json").read_text())
    assert manifest["ptxas"] == str(ptxas)
    for rec in manifest["kernels"]:
        info = rec["ptxas"]
        assert 0 < info["registers"] <= 255, rec["file"]
        assert info["spill_store_bytes"] == 0 and info["spill_load_bytes"] == 0, (rec["file"], info)
        if rec["dtype"] == "bfloat16" and rec["head_dim"] == 128:
            proc = subprocess.run(
                [
                    ptxas,
                    "-arch=sm_90a",
                    "-v",
                    str(built_ptx / rec["file"]),
                    "-o",
                    str(tmp_path / "k"),
                ],
                capture_output=True,
                text=True,
            )
            assert proc.returncode == 0, proc.stderr[-2000:]
            assert "0 bytes spill stores" in proc.stderr, (rec["file"], proc.stderr[-1000:])
            assert parse_ptxas(proc.stderr) == info, rec["file"]
    hot = {k for k in KERNELS if k == "flash_prefill" or k.startswith("paged_")}
    assert {rec["kernel"] for rec in manifest["kernels"]} >= hot


def test_parse_ptxas_reads_registers_spills_and_shared_memory() -> None:
    # One entry of real `ptxas -v -arch=sm_90a` output (CUDA 13.0), with a spill.
    stderr = (
        "ptxas info    : 0 bytes gmem\n"
        "ptxas info    : Compiling entry function 'mk_fa_bf16_d256_x' for 'sm_90a'\n"
        "ptxas info    : Function properties for mk_fa_bf16_d256_x\n"
        "    224 bytes stack frame, 260 bytes spill stores, 1404 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 224 bytes cumulative stack size, "
        "43776 bytes smem\n"
    )
    assert parse_ptxas(stderr) == {
        "registers": 255,
        "stack_bytes": 224,
        "spill_store_bytes": 260,
        "spill_load_bytes": 1404,
        "static_shared_bytes": 43776,
    }
    with pytest.raises(RuntimeError, match="unexpected ptxas"):
        parse_ptxas("ptxas fatal   : Unresolved extern function")


def test_build_failure_reports_compiler_stderr(tmp_path: Path) -> None:
    mojo = _mojo()
    if mojo is None:
        pytest.skip("no mojo compiler in this environment")
    src = tmp_path / "src"
    src.mkdir()
    (src / "prefill_gpu.mojo").write_text("def broken(\n")
    for name in (
        "grid_order_gpu.mojo",
        "decode_gpu.mojo",
        "flash_prefill_gpu.mojo",
        "paged_decode_gpu.mojo",
    ):
        (src / name).write_text("")
    with pytest.raises(RuntimeError, match="mojo build of the GPU kernels failed") as info:
        ptx.build_ptx(mojo, src, tmp_path / "out")
    assert "Crashpad" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_pack_rejects_wrong_arguments() -> None:
    with pytest.raises(AssertionError):
        _pack("decode_combine", {"out": 0, "part_o": 0, "part_lse": 0})
    with pytest.raises(ValueError, match="int32"):
        _pack("decode_combine", {"out": 0, "part_o": 0, "part_lse": 0, "num_splits": 2**31})


def test_both_builds_check_entries_and_manifests_alike(tmp_path: Path) -> None:
    """One check_signature and one load_manifest serve the attention and the fused PTX."""
    check_signature(SIGNATURES, "decode_combine", [".u64", ".u64", ".u64", ".b32"])
    with pytest.raises(RuntimeError, match="silu_mul: PTX entry parameters"):
        check_signature(fused_ptx.SIGNATURES, "silu_mul", [".u64", ".u64"])
    with pytest.raises(FileNotFoundError, match="mili kernels build --gpu"):
        load_manifest(tmp_path, ptx.MANIFEST_FORMAT)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": fused_ptx.MANIFEST_FORMAT}))
    assert load_manifest(tmp_path, fused_ptx.MANIFEST_FORMAT)["format"] == 1
    with pytest.raises(RuntimeError, match="manifest format 1, expected 2; rebuild the PTX"):
        load_manifest(tmp_path, ptx.MANIFEST_FORMAT)


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


def _grid_case(
    q_lens: list[int],
    context_lens: list[int],
    ratio: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> PagedCase:
    """A batch of the grid on the GPU: 2 kv heads, `ratio` query heads each."""
    return make_case(
        q_lens,
        context_lens,
        num_q_heads=2 * ratio,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
        seed=seed,
    )


def _grid_prefill(
    ratio: int, head_dim: int, block_size: int, dtype: torch.dtype, seed: int
) -> PagedCase:
    """The grid's prefill batch: lengths 1 .. 513 and an empty chunk, fresh and after cached
    prefixes (mid-block, on a block boundary, a long one)."""
    return _grid_case(
        [1, 7, 16, 17, 100, 513, 0, 7],
        [0, 3, 16, 5, 0, 0, 9, 513],
        ratio,
        head_dim,
        block_size,
        dtype,
        seed,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_tensor_core_kernels_on_the_parity_grid(gpu_kernels, head_dim: int, dtype) -> None:
    """flash_prefill and paged_decode in fp16 (test_parity.py's grid runs bf16) over lengths
    1 .. 513, ratios 1 .. 16 and odd, both block sizes, cached prefixes and forced splits."""
    lengths = (1, 7, 16, 17, 100, 513)
    for ratio in (1, 2, 3, 4, 5, 8, 16):
        for block_size in (16, 32):
            seed = ratio * 1000 + head_dim + block_size
            prefill = _grid_prefill(ratio, head_dim, block_size, dtype, seed)
            assert_close(run_prefill(gpu_kernels, prefill), reference_prefill(prefill), dtype)
            decode = _grid_case(
                [1] * len(lengths),
                [n - 1 for n in lengths],
                ratio,
                head_dim,
                block_size,
                dtype,
                seed + 1,
            )
            expected = reference_decode(decode)
            for splits in (0, 1, 3, 64):
                assert_close(run_decode(gpu_kernels, decode, splits), expected, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_narrow_flash_prefill_on_the_parity_grid(gpu_kernels, head_dim: int, dtype) -> None:
    """flash_prefill_3cta (32-key tiles, Q from shared memory, >= 3 CTAs an SM) over the grid
    above: within the tolerance of the reference, and of the default kernel's own output."""
    narrow = GpuKernels(gpu_kernels.kernel_dir, flash_prefill="flash_prefill_3cta")
    for ratio in (1, 2, 3, 4, 8, 16):
        for block_size in (16, 32):
            seed = ratio * 100 + head_dim + block_size
            case = _grid_prefill(ratio, head_dim, block_size, dtype, seed)
            out = run_prefill(narrow, case)
            assert_close(out, reference_prefill(case), dtype)
            assert_close(out, run_prefill(gpu_kernels, case), dtype)


def test_the_prefill_kernel_is_one_of_the_built_ones(tmp_path: Path) -> None:
    assert GpuKernels(tmp_path, flash_prefill="flash_prefill_3cta").flash_prefill.endswith("3cta")
    with pytest.raises(ValueError, match="no prefill kernel 'flash_prefill_4cta'"):
        GpuKernels(tmp_path, flash_prefill="flash_prefill_4cta")


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_decode_captured_in_a_cuda_graph_replays_new_inputs(gpu_kernels, batch: int) -> None:
    """A decode step captured once replays right after q, the cache and the lengths change in
    place (the split plan depends on shapes only; scratch is preallocated)."""
    assert gpu_kernels.is_graph_safe
    contexts = [(97 * i) % 4000 + 1 for i in range(1, batch + 1)]

    def case(seed: int) -> PagedCase:
        return make_case(
            [1] * batch,
            [c - 1 for c in contexts],
            num_q_heads=32,
            num_kv_heads=8,
            head_dim=128,
            block_size=16,
            dtype=torch.bfloat16,
            device="cuda",
            seed=seed,
        )

    first = case(1)
    run_decode(gpu_kernels, first)  # warm-up: loads the functions and sizes the scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_decode(gpu_kernels, first)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference_decode(first), torch.bfloat16)

    second = case(2)  # same shapes, new values: copy them into the captured tensors
    for name in ("q", "k_cache", "v_cache", "block_tables"):
        getattr(first, name).copy_(getattr(second, name))
    # Shorter contexts, then each one split long (at batch 1 the plan has many splits: a short
    # context runs one, a long one merges in its last split), then the originals: every replay
    # starts from split counters at 0 and writes every output row (NaN before it).
    lengths = (
        torch.clamp(second.seq_lens - 50, min=1),
        torch.clamp(second.seq_lens, max=PAGED_DECODE_MIN_SPLIT_KEYS),
        second.seq_lens.clone(),
    )
    for seq_lens in lengths:
        first.seq_lens.copy_(seq_lens)
        second.seq_lens = seq_lens
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, reference_decode(second), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_split_decodes_in_a_row_each_merge_their_own_splits(gpu_kernels, dtype) -> None:
    """paged_decode's last split merges, counted in counters it leaves at 0: calls one after
    another (other batches, lengths and split counts) are each right."""
    for seed, (contexts, splits) in enumerate(
        [([513, 1, 100], 7), ([4000], 0), ([65, 64, 2000, 17], 3), ([513, 1, 100], 7)]
    ):
        case = make_case(
            [1] * len(contexts),
            [c - 1 for c in contexts],
            num_q_heads=16,
            num_kv_heads=8,
            head_dim=128,
            block_size=16,
            dtype=dtype,
            device="cuda",
            seed=seed,
        )
        assert_close(run_decode(gpu_kernels, case, splits), reference_decode(case), dtype)


_CUDA_H_JIT_OPTIONS = {
    "CU_JIT_INFO_LOG_BUFFER": 3,
    "CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES": 4,
    "CU_JIT_ERROR_LOG_BUFFER": 5,
    "CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES": 6,
}

# A PTX the driver cannot JIT: its one instruction reads a register never declared.
_UNJITTABLE_PTX = """\
.version 8.0
.target sm_90
.address_size 64

.visible .entry mili_unjittable()
{
    .reg .b32 %r<2>;
    mov.u32 %r1, %mili_undeclared;
    ret;
}
"""


@pytest.mark.gpu
def test_a_ptx_that_fails_to_jit_reports_the_entry_and_the_ptxas_log() -> None:
    """The load's error names the entry and quotes the driver's JIT error log, which names the
    bad operand (kernels/jit_log.py; without the log it said only CUDA_ERROR_INVALID_PTX)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kernels.cuda_driver import _CudaPythonDriver

    try:
        driver = _CudaPythonDriver()
    except ImportError:
        pytest.skip("needs cuda-python (the CuPy route loads without JIT logs)")
    # The bindings' numbers of the options kernels/jit_log.py passes by name are cuda.h's.
    numbers = {name: getattr(driver.drv.CUjit_option, name).value for name in _CUDA_H_JIT_OPTIONS}
    assert numbers == _CUDA_H_JIT_OPTIONS
    torch.zeros(1, device="cuda")  # torch initialises the driver and the primary context
    with pytest.raises(RuntimeError) as info:
        driver.load(torch.cuda.current_device(), _UNJITTABLE_PTX, "mili_unjittable", 0)
    message = str(info.value)
    assert message.startswith("cuModuleLoadDataEx(mili_unjittable) failed"), message
    assert "\nJIT error log:\n" in message, message
    error_log = message.split("\nJIT error log:\n", 1)[1]
    assert "mili_undeclared" in error_log, message


@pytest.mark.gpu
def test_without_the_split_decode_every_sequence_runs_one_split(gpu_kernels) -> None:
    """After its self-check failure (kernels/choice.py) the split decode is not run: a batch
    the plan would split (batch 1, a wide table) comes out right from one split a sequence."""
    kernels = GpuKernels(gpu_kernels.kernel_dir)
    assert kernels.fall_back("attention.decode_split")
    case = make_case(
        [1],
        [3999],
        num_q_heads=16,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
    )
    assert_close(run_decode(kernels, case), reference_decode(case), torch.bfloat16)
    assert_close(run_decode(kernels, case, 7), reference_decode(case), torch.bfloat16)
