"""The Mojo CPU kernels against the torch reference (fp64) over the issue's grid of shapes.

Lengths 1, 7, 16, 17, 100, 513; q/kv head ratios 1, 2, 4, 8; head_dim 64 and 128; block sizes 16
and 32; random block tables; mixed-length batches; cached prefixes (chunked prefill, prefix reuse).
fp32 within 1e-5, bf16/fp16 within 2e-2 of the output's magnitude (tests/kernels/cases.py).
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import CpuKernels
from tests.kernels.cases import (
    PagedCase,
    assert_close,
    make_case,
    reference_decode,
    reference_prefill,
)

LENGTHS = (1, 7, 16, 17, 100, 513)
RATIOS = (1, 2, 4, 8)
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (16, 32)
DTYPES = (torch.float32, torch.bfloat16)
KV_HEADS = 2


def _prefill(kernels: CpuKernels, case: PagedCase) -> torch.Tensor:
    return kernels.prefill(
        case.q,
        case.k_cache,
        case.v_cache,
        case.cu_seqlens,
        case.start_positions,
        case.block_tables,
        scale=case.scale,
    )


def _decode(kernels: CpuKernels, case: PagedCase, num_splits: int = 0) -> torch.Tensor:
    return kernels.decode(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        scale=case.scale,
        num_splits=num_splits,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_fresh_prompt(
    cpu_kernels: CpuKernels, length: int, ratio: int, head_dim: int, block_size: int, dtype
) -> None:
    case = make_case(
        [length],
        [0],
        num_q_heads=KV_HEADS * ratio,
        num_kv_heads=KV_HEADS,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=length,
    )
    assert_close(_prefill(cpu_kernels, case), reference_prefill(case), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_prefill_mixed_batch_with_cached_prefixes(
    cpu_kernels: CpuKernels, ratio: int, head_dim: int, block_size: int, dtype
) -> None:
    # Fresh prompts, chunked-prefill continuations (start > 0, mid-block and on a block
    # boundary), a prefix-reuse hit with a long prefix, and an empty chunk, packed together.
    new_lens = [1, 7, 16, 17, 100, 513, 0, 7]
    starts = [0, 3, 16, 5, 0, 0, 9, 513]
    case = make_case(
        new_lens,
        starts,
        num_q_heads=KV_HEADS * ratio,
        num_kv_heads=KV_HEADS,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=ratio * head_dim + block_size,
    )
    assert_close(_prefill(cpu_kernels, case), reference_prefill(case), dtype)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "ratio"),
    [
        (torch.float16, 64, 2),
        (torch.float16, 128, 8),
        (torch.float32, 256, 4),
        (torch.bfloat16, 256, 1),
    ],
    ids=str,
)
def test_prefill_other_dtypes_and_head_dims(
    cpu_kernels: CpuKernels, dtype, head_dim: int, ratio: int
) -> None:
    case = make_case(
        [17, 100, 1],
        [0, 33, 200],
        num_q_heads=KV_HEADS * ratio,
        num_kv_heads=KV_HEADS,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
    )
    assert_close(_prefill(cpu_kernels, case), reference_prefill(case), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("context", LENGTHS)
def test_decode_one_sequence(
    cpu_kernels: CpuKernels, context: int, ratio: int, head_dim: int, block_size: int, dtype
) -> None:
    case = make_case(
        [1],
        [context - 1],
        num_q_heads=KV_HEADS * ratio,
        num_kv_heads=KV_HEADS,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=context,
    )
    assert_close(_decode(cpu_kernels, case), reference_decode(case), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_decode_mixed_batch(
    cpu_kernels: CpuKernels, ratio: int, head_dim: int, block_size: int, dtype
) -> None:
    contexts = [513, 1, 17, 7, 100, 16, 64, 33]
    case = make_case(
        [1] * len(contexts),
        [c - 1 for c in contexts],
        num_q_heads=KV_HEADS * ratio,
        num_kv_heads=KV_HEADS,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=ratio + head_dim + block_size,
    )
    assert_close(_decode(cpu_kernels, case), reference_decode(case), dtype)


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float16), ids=str)
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
def test_decode_split_along_the_sequence(cpu_kernels: CpuKernels, num_splits: int, dtype) -> None:
    # More splits than blocks (64 > 33 blocks of 16) must leave the extra splits empty, not wrong.
    contexts = [513, 1, 100]
    case = make_case(
        [1] * len(contexts),
        [c - 1 for c in contexts],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        block_size=16,
        dtype=dtype,
        seed=num_splits,
    )
    assert_close(_decode(cpu_kernels, case, num_splits), reference_decode(case), dtype)


def test_decode_head_dim_256(cpu_kernels: CpuKernels) -> None:
    case = make_case(
        [1, 1],
        [99, 16],
        num_q_heads=4,
        num_kv_heads=4,
        head_dim=256,
        block_size=32,
        dtype=torch.float32,
    )
    assert_close(_decode(cpu_kernels, case), reference_decode(case), torch.float32)


def test_prefill_matches_its_own_decode(cpu_kernels: CpuKernels) -> None:
    # The last prompt token's prefill output is the decode output over the same context.
    case = make_case(
        [40], [0], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32
    )
    last = _prefill(cpu_kernels, case)[-1:]
    step = cpu_kernels.decode(
        case.q[-1:].contiguous(),
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        scale=case.scale,
    )
    torch.testing.assert_close(last, step, rtol=1e-5, atol=1e-5)
