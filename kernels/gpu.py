"""Loader and launcher of the ahead-of-time PTX attention kernels (see kernels/ptx.py).

The GPU host needs no Mojo toolchain: the PTX built by `kernels.ptx.build_ptx` is JIT-compiled by
the CUDA driver (`cuModuleLoadDataEx`; a failed load reports ptxas's log, kernels/jit_log.py) and
launched with `cuLaunchKernel` on torch's current stream with torch tensors' device pointers
(both through kernels/cuda_driver.py). Nothing here synchronises the host: index tensors are not
read back (`check_values=False`), scratch comes from torch's caching allocator on the same stream.

bf16/fp16 run the tensor-core `flash_prefill` and the FlashInfer-style `paged_decode_g<GC>`
(launch geometry: kernels/geometry.py); fp32 keeps the CUDA-core `prefill` and `decode`. Both new
kernels take dynamic shared memory beyond 48 KB: each function's limit is raised to the manifest's
`dynamic_shared_bytes` when it is loaded.

CUDA graphs (`is_graph_safe`): a decode call reads nothing back from the device, picks its split
plan from shapes only, and writes split partials (and paged_decode its split counters, zeroed
once: each launch leaves them at 0) into preallocated per-device scratch that only grows (old
buffers stay alive, so graphs captured earlier keep valid pointers; growing during a capture is
refused: warm up at the largest batch first). Functions are loaded on the first call,
which must therefore precede any capture (the usual warm-up does it).
"""

from __future__ import annotations

import ctypes
import math
import threading
from pathlib import Path
from typing import Any

import torch

from kernels.checks import check_decode, check_prefill
from kernels.cuda_driver import (
    _MAX_GRID_X,
    _MAX_GRID_YZ,
    _CudaPythonDriver,
    _make_driver,
    pack_arguments,
)
from kernels.geometry import (
    DECODE_HEADS_PER_CTA,
    MAX_DECODE_SPLITS,
    THREADS,
    decode_group_size,
    decode_splits,
    prefill_tiling,
)
from kernels.manifest import load_manifest
from kernels.ptx import MANIFEST_FORMAT
from kernels.ptx_entry import check_signature, parse_entries
from kernels.signatures import KERNELS, SIGNATURES

_LOG2E = 1.4426950408889634
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)


def _pack(kernel: str, values: dict[str, int | float]) -> list[ctypes._SimpleCData]:
    """Launch arguments in the entry's parameter order (kernels.signatures.SIGNATURES)."""
    return pack_arguments(SIGNATURES, kernel, values)


# The bf16/fp16 prefill kernels the build makes: the default and its variants.
_FLASH_PREFILLS = tuple(k for k in KERNELS if k.startswith("flash_prefill"))


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


class GpuKernels:
    """An AttentionBackend (mili.engine.model.attention) on an NVIDIA sm_90 GPU, from a
    directory of built PTX."""

    name = "mojo"
    is_graph_safe = True  # decode can be captured in a CUDA graph (see the module docstring)

    def __init__(self, kernel_dir: str | Path, *, flash_prefill: str = "flash_prefill") -> None:
        """`flash_prefill`: the bf16/fp16 prefill kernel, "flash_prefill" (what serving runs)
        or its narrow variant "flash_prefill_3cta" (flash_prefill_gpu.mojo's header: measured
        beside it by benchmarks/attention_gpu.py)."""
        if flash_prefill not in _FLASH_PREFILLS:
            raise ValueError(f"no prefill kernel {flash_prefill!r}")
        self.kernel_dir = Path(kernel_dir)
        self.flash_prefill = flash_prefill
        self._manifest: dict | None = None
        self._driver: _CudaPythonDriver | None = None
        # (device, kernel, dtype, head_dim) -> (function, dynamic shared bytes)
        self._functions: dict[tuple[int, str, str, int], tuple[Any, int]] = {}
        self._sms: dict[int, int] = {}
        # (device, dtype) -> split scratch (flat): fp32 parts, int32 paged_decode counters;
        # grown, never freed (captured graphs point into it)
        self._scratch: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []
        self._lock = threading.Lock()
        # Launch each kernel overlapping the previous one's tail (kernels/cuda_driver.py): off
        # until a GPU run measures it (benchmarks/engine_gpu.py --overlap-launches).
        self.overlap_launches = False
        # False once the split decode failed the start-up self-check (`fall_back`): every
        # decode then runs one split a sequence, the path the narrow-table check passed.
        self.split_decode = True

    # -- loading ---------------------------------------------------------------------------

    @property
    def manifest(self) -> dict:
        if self._manifest is None:
            self._manifest = load_manifest(self.kernel_dir, MANIFEST_FORMAT)
        return self._manifest

    def _record(self, kernel: str, dtype: str, head_dim: int) -> dict:
        for rec in self.manifest["kernels"]:
            if (rec["kernel"], rec["dtype"], rec["head_dim"]) == (kernel, dtype, head_dim):
                return rec
        raise RuntimeError(f"{self.kernel_dir}/manifest.json has no {kernel} {dtype} D={head_dim}")

    def _function(self, device: int, kernel: str, dtype: str, head_dim: int) -> tuple[Any, int]:
        key = (device, kernel, dtype, head_dim)
        func = self._functions.get(key)
        if func is not None:
            return func
        with self._lock:
            func = self._functions.get(key)
            if func is None:
                rec = self._record(kernel, dtype, head_dim)
                ptx = (self.kernel_dir / rec["file"]).read_text()
                entries = parse_entries(ptx)
                if rec["entry"] not in entries:
                    raise RuntimeError(
                        f"{rec['file']} has no entry {rec['entry']} (found {sorted(entries)}): "
                        "the PTX directory is inconsistent; rebuild it"
                    )
                check_signature(SIGNATURES, kernel, entries[rec["entry"]])
                if self._driver is None:
                    self._driver = _make_driver()
                shared = int(rec.get("dynamic_shared_bytes", 0))
                func = (self._driver.load(device, ptx, rec["entry"], shared), shared)
                self._functions[key] = func
        return func

    def _launch(
        self,
        device: int,
        kernel: str,
        dtype: str,
        head_dim: int,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        values: dict[str, int | float],
    ) -> None:
        if not (
            0 < grid[0] <= _MAX_GRID_X
            and 0 < grid[1] <= _MAX_GRID_YZ
            and 0 < grid[2] <= _MAX_GRID_YZ
        ):
            raise ValueError(f"{kernel}: grid {grid} out of the CUDA limits")
        args = _pack(kernel, values)
        with torch.cuda.device(device):
            func, shared = self._function(device, kernel, dtype, head_dim)
            stream = torch.cuda.current_stream(device).cuda_stream
            assert self._driver is not None
            self._driver.launch(
                device, func, grid, block, stream, args, shared, self.overlap_launches
            )

    def fall_back(self, kernel: str) -> bool:
        """Do without the self-check's `kernel` (kernels/choice.py), if only it failed:
        attention.decode_split -> one split a sequence. False for any other kernel."""
        if kernel != "attention.decode_split":
            return False
        self.split_decode = False
        return True

    def _num_sms(self, device: int) -> int:
        if device not in self._sms:
            self._sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
        return self._sms[device]

    @staticmethod
    def _device(q: torch.Tensor) -> int:
        if not q.is_cuda:
            raise ValueError(f"GpuKernels needs CUDA tensors, q is on {q.device}")
        return q.device.index if q.device.index is not None else torch.cuda.current_device()

    @staticmethod
    def _check_alignment(**tensors: torch.Tensor) -> None:
        for name, t in tensors.items():
            if t.numel() and not _aligned(t):
                raise ValueError(f"{name}'s data pointer must be 16-byte aligned")

    # -- kernels ---------------------------------------------------------------------------

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        start_positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        """Causal GQA prefill over the paged cache: q [T, H, D] -> out [T, H, D] (q's dtype).
        Every key and value, new tokens' too, is read from the cache: `k`/`v` go unused."""
        device = self._device(q)
        dims = check_prefill(
            q,
            k_cache,
            v_cache,
            cu_seqlens,
            start_positions,
            block_tables,
            scale=scale,
            check_values=False,
        )
        if not _aligned(q):
            q = q.clone()  # a contiguous view at an odd offset: the kernel loads 16 bytes at once
        self._check_alignment(k_cache=k_cache, v_cache=v_cache)
        out = torch.empty_like(q)
        if dims.num_tokens == 0 or dims.num_seqs == 0:
            return out
        if q.dtype in _TENSOR_CORE_DTYPES:
            kernel = self.flash_prefill  # a CTA: a tile of tokens x a kv group's query heads
            grid = prefill_tiling(
                dims.num_tokens, dims.num_q_heads, dims.num_kv_heads, dims.num_seqs
            ).grid
        else:
            kernel = "prefill"  # fp32 on CUDA cores: a CTA is a tile of tokens x one head
            block_m = int(self.manifest["prefill_block_m"][str(dims.head_dim)])
            grid = (math.ceil(dims.num_tokens / block_m), dims.num_q_heads, dims.num_seqs)
        self._launch(
            device,
            kernel,
            _DTYPE_NAMES[q.dtype],
            dims.head_dim,
            grid,
            (THREADS, 1, 1),
            {
                "out": out.data_ptr(),
                "q": q.data_ptr(),
                "k_cache": k_cache.data_ptr(),
                "v_cache": v_cache.data_ptr(),
                "cu_seqlens": cu_seqlens.data_ptr(),
                "start_positions": start_positions.data_ptr(),
                "block_tables": block_tables.data_ptr(),
                "num_q_heads": dims.num_q_heads,
                "num_kv_heads": dims.num_kv_heads,
                "block_size": dims.block_size,
                "max_blocks": dims.max_blocks,
                "scale_log2": scale * _LOG2E,
            },
        )
        return out

    def _split_scratch(
        self, device: int, numel: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """At least `numel` of this device's split scratch: float32 for part_o then part_lse,
        int32 for paged_decode's counters (zeros; every launch leaves them so).

        Decode calls on one device are stream-ordered (one engine loop), so they share it."""
        buf = self._scratch.get((device, dtype))
        if buf is None or buf.numel() < numel:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"decode needs {numel} floats of split scratch during a CUDA graph capture "
                    f"but has {0 if buf is None else buf.numel()}: run decode once at the "
                    "largest captured batch before capturing"
                )
            if buf is not None:
                self._retired.append(buf)  # graphs captured on it still write there
            size = max(numel, 2 * (0 if buf is None else buf.numel()))
            buf = torch.zeros(size, dtype=dtype, device=torch.device("cuda", device))
            self._scratch[(device, dtype)] = buf
        return buf

    def decode_splits(
        self, device: int, num_seqs: int, num_kv_heads: int, num_q_heads: int, max_context: int
    ) -> int:
        """Splits per sequence of the fp32 `decode` kernel when the caller asks for automatic
        (num_splits=0): enough CTAs for about two per SM, each split at least 256 keys of the
        longest possible context (max_blocks * block_size: the real lengths stay on the
        device). bf16/fp16 use kernels.geometry.decode_splits."""
        chunks = math.ceil((num_q_heads // num_kv_heads) / DECODE_HEADS_PER_CTA)
        ctas = num_seqs * num_kv_heads * chunks
        want = math.ceil(2 * self._num_sms(device) / max(ctas, 1))
        useful = max(1, math.ceil(max_context / 256))
        return max(1, min(want, useful, MAX_DECODE_SPLITS))

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        scale: float,
        num_splits: int = 0,
    ) -> torch.Tensor:
        """GQA decode over the paged cache: q [B, H, D] -> out [B, H, D] (q's dtype).

        num_splits: chunks each sequence is cut into (flash-decoding); 0 picks it from the
        batch size and the block table width.
        """
        device = self._device(q)
        dims = check_decode(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            scale=scale,
            num_splits=num_splits,
            check_values=False,
        )
        if not _aligned(q):
            q = q.clone()
        self._check_alignment(k_cache=k_cache, v_cache=v_cache)
        out = torch.empty_like(q)
        num_seqs, heads, kv_heads, head_dim = (
            dims.num_seqs,
            dims.num_q_heads,
            dims.num_kv_heads,
            dims.head_dim,
        )
        if num_seqs == 0:
            return out
        max_context = dims.max_blocks * dims.block_size
        group = heads // kv_heads
        # paged_decode (bf16/fp16) merges its own splits; fp32's decode leaves that to
        # decode_combine
        paged = q.dtype in _TENSOR_CORE_DTYPES
        if paged:
            per_cta = decode_group_size(group)  # paged_decode_g<per_cta>: all of G <= 8
            kernel = f"paged_decode_g{per_cta}"
            splits = num_splits or decode_splits(
                num_seqs, kv_heads, heads, max_context, self._num_sms(device)
            )
        else:
            per_cta = DECODE_HEADS_PER_CTA
            kernel = "decode"
            splits = num_splits or self.decode_splits(
                device, num_seqs, kv_heads, heads, max_context
            )
        if not self.split_decode:
            splits = 1
        chunks = math.ceil(group / per_cta)
        dtype = _DTYPE_NAMES[q.dtype]
        # The kernel writes `out` directly with one split and never touches the scratch pointers.
        part_o_ptr = part_lse_ptr = counters_ptr = out.data_ptr()
        if splits > 1:
            # part_o [B, H, splits, D] then part_lse [B, H, splits], fp32, in the scratch
            rows = num_seqs * heads * splits
            scratch = self._split_scratch(device, rows * (head_dim + 1))
            part_o_ptr = scratch.data_ptr()
            part_lse_ptr = part_o_ptr + rows * head_dim * 4
            if paged:
                # paged_decode's counters [B, KVH * chunks]: its last split to finish merges
                counters = self._split_scratch(device, num_seqs * kv_heads * chunks, torch.int32)
                counters_ptr = counters.data_ptr()
        values: dict[str, int | float] = {
            "out": out.data_ptr(),
            "part_o": part_o_ptr,
            "part_lse": part_lse_ptr,
            "q": q.data_ptr(),
            "k_cache": k_cache.data_ptr(),
            "v_cache": v_cache.data_ptr(),
            "block_tables": block_tables.data_ptr(),
            "seq_lens": seq_lens.data_ptr(),
            "num_q_heads": heads,
            "num_kv_heads": kv_heads,
            "block_size": dims.block_size,
            "max_blocks": dims.max_blocks,
            "num_splits": splits,
            "scale_log2": scale * _LOG2E,
        }
        if paged:
            values["counters"] = counters_ptr
        grid = (splits, kv_heads * chunks, num_seqs)
        self._launch(device, kernel, dtype, head_dim, grid, (THREADS, 1, 1), values)
        if splits > 1 and not paged:
            self._launch(
                device,
                "decode_combine",
                dtype,
                head_dim,
                (num_seqs * heads, 1, 1),
                (head_dim, 1, 1),
                {
                    "out": out.data_ptr(),
                    "part_o": part_o_ptr,
                    "part_lse": part_lse_ptr,
                    "num_splits": splits,
                },
            )
        return out
