"""Every kernel implementation (CPU; sm_90 where a GPU is present) against the fp64 torch
reference over the issue's grid of shapes.

Lengths 1, 7, 16, 17, 100, 513; q/kv head ratios 1, 2, 4, 8 (and 16, odd ones); head_dim 64 and
128 (and 256); block sizes 16 and 32; random block tables; mixed-length batches; cached prefixes
(chunked prefill, prefix reuse); forced sequence splits in decode. fp32 within 1e-5, bf16/fp16
within 2e-2 of the output's magnitude (tests/kernels/cases.py).
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import CpuKernels
from kernels.gpu import GpuKernels
from tests.kernels.cases import (
    assert_close,
    make_case,
    poison_unread_slots,
    reference_decode,
    reference_prefill,
    run_decode,
    run_prefill,
)

LENGTHS = (1, 7, 16, 17, 100, 513)
RATIOS = (1, 2, 4, 8)
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (16, 32)
DTYPES = (torch.float32, torch.bfloat16)
ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KV_HEADS = 2

Kernels = tuple[str, CpuKernels | GpuKernels]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_fresh_prompt(
    device_kernels: Kernels, length: int, ratio: int, head_dim: int, block_size: int, dtype
) -> None:
    device, kernels = device_kernels
    case = make_case(
        [length],
        [0],
        num_q_heads=KV_HEADS * ratio,
        num_kv_heads=KV_HEADS,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        seed=length,
    )
    assert_close(run_prefill(kernels, case), reference_prefill(case), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_prefill_mixed_batch_with_cached_prefixes(
    device_kernels: Kernels, ratio: int, head_dim: int, block_size: int, dtype
) -> None:
    # Fresh prompts, chunked-prefill continuations (start > 0, mid-block and on a block
    # boundary), a prefix-reuse hit with a long prefix, and an empty chunk, packed together.
    device, kernels = device_kernels
    case = make_case(
        [1, 7, 16, 17, 100, 513, 0, 7],
        [0, 3, 16, 5, 0, 0, 9, 513],
        num_q_heads=KV_HEADS * ratio,
        num_kv_heads=KV_HEADS,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        seed=ratio * head_dim + block_size,
    )
    assert_close(run_prefill(kernels, case), reference_prefill(case), dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_prefill_every_specialisation(device_kernels: Kernels, head_dim: int, dtype) -> None:
    device, kernels = device_kernels
    case = make_case(
        [33, 1, 70],
        [0, 40, 9],
        num_q_heads=12,  # ratio 3
        num_kv_heads=4,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device=device,
        seed=head_dim,
    )
    assert_close(run_prefill(kernels, case), reference_prefill(case), dtype)


@pytest.mark.parametrize(
    "lengths, starts, heads, head_dim, block_size",
    [
        # one head per group at D = 256 (64 tokens a CTA, 32-key tiles), start 1: a warp's
        # rows end before a tile that the CTA's other warps still compute, and the copies of
        # the tiles after it are issued by all of them
        ([100], [1], (2, 2), 256, 16),
        ([40, 100], [0, 17], (2, 2), 256, 16),
        ([300], [0], (2, 2), 128, 5),  # blocks that do not divide a 64-key tile
        ([300], [5], (2, 2), 64, 128),  # a block that spans two tiles
        ([1000], [37], (8, 2), 128, 5),  # 16 tiles: many block ids, each looked up ahead
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_prefill_tiles_and_blocks_that_do_not_line_up(
    device_kernels: Kernels,
    lengths: list[int],
    starts: list[int],
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    dtype,
) -> None:
    """The tensor-core prefill's tile loop on its rarer paths: a warp that skips a tile while
    its CTA goes on, block sizes that split or straddle its key tiles, long block tables."""
    device, kernels = device_kernels
    case = make_case(
        lengths,
        starts,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        seed=sum(lengths) + block_size,
    )
    assert_close(run_prefill(kernels, case), reference_prefill(case), dtype)


@pytest.mark.parametrize("block_size", [5, 64])
@pytest.mark.parametrize("ratio", [2, 4])
@pytest.mark.parametrize("context", [100, 3000])
def test_decode_block_sizes_that_do_not_divide_a_tile(
    device_kernels: Kernels, context: int, ratio: int, block_size: int
) -> None:
    """Block sizes that do not divide the paged kernel's 32-key tiles, so its copies carry
    their block offsets over from tile to tile: 5 (a tile spans blocks unevenly) and 64 (a block
    spans two tiles); at 5 a context over its 512-block id window (2,560 keys): one split, so
    one CTA reads it all, window after window."""
    device, kernels = device_kernels
    case = make_case(
        [1],
        [context - 1],
        num_q_heads=KV_HEADS * ratio,
        num_kv_heads=KV_HEADS,
        head_dim=128,
        block_size=block_size,
        dtype=torch.bfloat16,
        device=device,
        seed=context + block_size,
    )
    assert_close(run_decode(kernels, case, num_splits=1), reference_decode(case), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("context", LENGTHS)
def test_decode_one_sequence(
    device_kernels: Kernels, context: int, ratio: int, head_dim: int, block_size: int, dtype
) -> None:
    device, kernels = device_kernels
    case = make_case(
        [1],
        [context - 1],
        num_q_heads=KV_HEADS * ratio,
        num_kv_heads=KV_HEADS,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        seed=context,
    )
    assert_close(run_decode(kernels, case), reference_decode(case), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_decode_mixed_batch(
    device_kernels: Kernels, ratio: int, head_dim: int, block_size: int, dtype
) -> None:
    device, kernels = device_kernels
    contexts = [513, 1, 17, 7, 100, 16, 64, 33]
    case = make_case(
        [1] * len(contexts),
        [c - 1 for c in contexts],
        num_q_heads=KV_HEADS * ratio,
        num_kv_heads=KV_HEADS,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        seed=ratio + head_dim + block_size,
    )
    assert_close(run_decode(kernels, case), reference_decode(case), dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
def test_decode_split_along_the_sequence(device_kernels: Kernels, num_splits: int, dtype) -> None:
    # More splits than blocks (64 > 33 blocks of 16) must leave the extra splits empty, not wrong.
    device, kernels = device_kernels
    contexts = [513, 1, 100]
    case = make_case(
        [1] * len(contexts),
        [c - 1 for c in contexts],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        block_size=16,
        dtype=dtype,
        device=device,
        seed=num_splits,
    )
    assert_close(run_decode(kernels, case, num_splits), reference_decode(case), dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("heads", [(16, 1), (40, 8), (6, 2)], ids=str)
def test_decode_every_specialisation(
    device_kernels: Kernels, head_dim: int, dtype, heads: tuple[int, int]
) -> None:
    # Every dtype and head_dim, q/kv ratios above 8 (16) and odd (5, 3), automatic and forced
    # splits.
    device, kernels = device_kernels
    contexts = [1, 64, 1000]
    case = make_case(
        [1] * len(contexts),
        [c - 1 for c in contexts],
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device=device,
        seed=head_dim + heads[0],
    )
    expected = reference_decode(case)
    for splits in (0, 1, 7):
        assert_close(run_decode(kernels, case, splits), expected, dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_no_kernel_reads_a_slot_outside_the_context(device_kernels: Kernels, dtype) -> None:
    """A freed block keeps its last owner's K/V, inf or NaN included: no implementation, the
    torch reference either, may let a slot past a sequence's context reach its output."""
    device, kernels = device_kernels
    contexts = [5, 16, 33, 1]
    case = make_case(
        [1] * len(contexts),
        [c - 1 for c in contexts],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        device=device,
    )
    expected = reference_decode(case)
    poison_unread_slots(case)
    assert_close(run_decode(kernels, case), expected, dtype)
    for splits in (1, 3):
        assert_close(run_decode(kernels, case, splits), expected, dtype)
    assert_close(reference_decode(case), expected, dtype)


def test_prefill_matches_its_own_decode(device_kernels: Kernels) -> None:
    # The last prompt token's prefill output is the decode output over the same context.
    device, kernels = device_kernels
    case = make_case(
        [40],
        [0],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=device,
    )
    last = run_prefill(kernels, case)[-1:]
    step = kernels.decode(
        case.q[-1:].contiguous(),
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        scale=case.scale,
    )
    torch.testing.assert_close(last, step, rtol=1e-5, atol=1e-5)
