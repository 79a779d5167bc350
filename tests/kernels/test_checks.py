"""The binding refuses bad arguments with a message naming them, before any pointer crosses."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from kernels.cpu import CpuKernels
from kernels.geometry import MAX_DECODE_SPLITS
from tests.kernels.cases import PagedCase, make_case


@pytest.fixture
def case() -> PagedCase:
    return make_case(
        [5, 20], [0, 3], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32,
    )  # fmt: skip


def _prefill(kernels: CpuKernels, c: PagedCase, **changes: torch.Tensor) -> torch.Tensor:
    args = {
        "q": c.q,
        "k": c.k,
        "v": c.v,
        "k_cache": c.k_cache,
        "v_cache": c.v_cache,
        "cu_seqlens": c.cu_seqlens,
        "start_positions": c.start_positions,
        "block_tables": c.block_tables,
    }
    args.update(changes)
    return kernels.prefill(**args, scale=c.scale)


def _decode(kernels: CpuKernels, c: PagedCase, **changes: torch.Tensor) -> torch.Tensor:
    args = {
        "q": c.q[[4, 24]].contiguous(),  # one query per sequence
        "k_cache": c.k_cache,
        "v_cache": c.v_cache,
        "block_tables": c.block_tables,
        "seq_lens": c.seq_lens,
    }
    args.update(changes)
    return kernels.decode(**args, scale=c.scale)


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


PREFILL_ERRORS: list[tuple[str, Callable[[PagedCase], dict[str, torch.Tensor]], str]] = [
    ("q dtype", lambda c: {"q": c.q.double()}, "q has dtype torch.float64"),
    ("q strided", lambda c: {"q": c.q.transpose(0, 1).contiguous().transpose(0, 1)}, "contiguous"),
    ("q rank", lambda c: {"q": c.q.flatten(1)}, "q must have 3 dims"),
    ("cache dtype", lambda c: {"k_cache": c.k_cache.half()}, "k_cache has dtype"),
    ("cache shapes", lambda c: {"v_cache": c.v_cache[:-1]}, "differ in shape"),
    ("head_dim", lambda c: {"q": c.q[..., :32].contiguous()}, "head_dim 32 is not supported"),
    ("gqa", lambda c: {"q": c.q[:, :3].contiguous()}, "multiple of cache kv heads"),
    ("cu int64", lambda c: {"cu_seqlens": c.cu_seqlens.long()}, "cu_seqlens must be int32"),
    ("cu total", lambda c: {"cu_seqlens": torch.tensor([0, 5, 24], dtype=torch.int32)}, "rise"),
    ("cu order", lambda c: {"cu_seqlens": torch.tensor([0, 26, 25], dtype=torch.int32)}, "rise"),
    ("starts", lambda c: {"start_positions": torch.tensor([0], dtype=torch.int32)}, "entries"),
    ("negative", lambda c: {"start_positions": torch.tensor([0, -1], dtype=torch.int32)}, ">= 0"),
    ("start near 2^31", lambda c: {"start_positions": _i32([0, 2**31 - 2])}, "needs"),
    ("cu wraps", lambda c: {"cu_seqlens": _i32([0, 2**31 - 1, 25])}, "rise"),
    ("table rows", lambda c: {"block_tables": c.block_tables[:1]}, "block_tables has 1 rows"),
    ("table width", lambda c: {"block_tables": c.block_tables[:, :1].contiguous()}, "needs 2"),
    ("table ids", lambda c: {"block_tables": c.block_tables + 1000}, "outside [0,"),
    ("table strided", lambda c: {"block_tables": c.block_tables.t().contiguous().t()}, "contig"),
]


@pytest.mark.parametrize(
    ("what", "change", "message"), PREFILL_ERRORS, ids=[e[0] for e in PREFILL_ERRORS]
)
def test_prefill_rejects(cpu_kernels: CpuKernels, case: PagedCase, what, change, message) -> None:
    with pytest.raises((ValueError, TypeError), match=_escape(message)):
        _prefill(cpu_kernels, case, **change(case))


DECODE_ERRORS: list[tuple[str, Callable[[PagedCase], dict[str, torch.Tensor]], str]] = [
    ("lens count", lambda c: {"seq_lens": c.seq_lens[:1]}, "seq_lens has 1 entries"),
    ("zero len", lambda c: {"seq_lens": torch.tensor([0, 3], dtype=torch.int32)}, ">= 1"),
    ("too long", lambda c: {"seq_lens": torch.tensor([5, 999], dtype=torch.int32)}, "needs"),
    # near int32's top: its block count once wrapped negative, passed, and the kernel read
    # out of bounds (a segfault)
    ("near 2^31", lambda c: {"seq_lens": torch.tensor([5, 2**31 - 1], dtype=torch.int32)}, "needs"),
    ("lens dtype", lambda c: {"seq_lens": c.seq_lens.long()}, "seq_lens must be int32"),
    ("q fp16", lambda c: {"q": c.q[[4, 24]].half()}, "expected q's torch.float16"),
]


@pytest.mark.parametrize(
    ("what", "change", "message"), DECODE_ERRORS, ids=[e[0] for e in DECODE_ERRORS]
)
def test_decode_rejects(cpu_kernels: CpuKernels, case: PagedCase, what, change, message) -> None:
    with pytest.raises(ValueError, match=_escape(message)):
        _decode(cpu_kernels, case, **change(case))


@pytest.mark.parametrize("num_splits", [-1, MAX_DECODE_SPLITS + 1, 2**40, 2**62])
def test_decode_split_count_is_bounded(
    cpu_kernels: CpuKernels, case: PagedCase, num_splits: int
) -> None:
    """2**40 splits aborted the process (scratch allocation failed), 2**62 segfaulted (its
    size wrapped)."""
    args = {"k_cache": case.k_cache, "v_cache": case.v_cache, "block_tables": case.block_tables}
    with pytest.raises(ValueError, match=rf"num_splits must be in \[0, {MAX_DECODE_SPLITS}\]"):
        cpu_kernels.decode(
            case.q[[4, 24]].contiguous(),
            **args,
            seq_lens=case.seq_lens,
            scale=case.scale,
            num_splits=num_splits,
        )


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf")])
def test_scale_must_be_positive(cpu_kernels: CpuKernels, case: PagedCase, scale: float) -> None:
    """The kernels scale scores inside their softmax: only a positive scale keeps masked
    (-inf) scores at zero weight."""
    args = {"k_cache": case.k_cache, "v_cache": case.v_cache, "block_tables": case.block_tables}
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        cpu_kernels.prefill(
            case.q, case.k, case.v, case.cu_seqlens, case.start_positions, **args, scale=scale
        )
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        cpu_kernels.decode(
            case.q[[4, 24]].contiguous(), **args, seq_lens=case.seq_lens, scale=scale
        )


def test_valid_arguments_pass(cpu_kernels: CpuKernels, case: PagedCase) -> None:
    assert _prefill(cpu_kernels, case).shape == case.q.shape
    assert _decode(cpu_kernels, case).shape == (2, 4, 64)


def test_empty_batches_return_empty(cpu_kernels: CpuKernels, case: PagedCase) -> None:
    empty = case.q[:0]
    out = _prefill(
        cpu_kernels,
        case,
        q=empty,
        cu_seqlens=torch.zeros(1, dtype=torch.int32),
        start_positions=torch.zeros(0, dtype=torch.int32),
        block_tables=case.block_tables[:0],
    )
    assert out.shape == (0, 4, 64)


def _escape(text: str) -> str:
    return re.escape(text)
