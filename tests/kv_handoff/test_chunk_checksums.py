"""cuda-ipc's device checksum (mili.kv_handoff.cuda_ipc.chunk_checksums), on the CPU: plain
torch, so the definition is checked here against Python integers; the GPU check runs the
transport itself (tests/prefill/test_cuda_ipc.py, -m gpu)."""

from __future__ import annotations

import random

import pytest
import torch

from mili.kv_handoff.cuda_ipc import chunk_checksums

SHAPE = (40, 4, 2, 16)  # [num_blocks, block_size, num_kv_heads, head_dim]: 64 words a block


def reference(k_pool: torch.Tensor, v_pool: torch.Tensor, ids: list[int]) -> int:
    """The documented value, in Python integers: sum(x * (p % 65521 + 1 + side)) over each
    side's 32-bit words, K's times 31 plus V's, modulo 2^32."""
    total = 0
    for side, pool in enumerate((k_pool, v_pool)):
        words = pool[ids].reshape(-1).view(torch.int32).tolist()
        side_sum = sum(x * (p % 65521 + 1 + side) for p, x in enumerate(words))
        total = total * 31 + side_sum
    return total & 0xFFFFFFFF


def pools(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(SHAPE, generator=g).mul(1e3).to(dtype) for _ in range(2))  # type: ignore[return-value]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_chunk_gets_the_documented_value(dtype: torch.dtype) -> None:
    rng = random.Random(7)
    layers = [pools(seed, dtype) for seed in range(3)]
    chunks = []
    for layer in (0, 2, 1, 2):
        ids = rng.sample(range(SHAPE[0]), rng.randint(1, 9))  # scattered, as a free list gives
        chunks.append((*layers[layer], ids))
    got = chunk_checksums([(k, v, torch.tensor(ids)) for k, v, ids in chunks])
    assert got == [reference(k, v, ids) for k, v, ids in chunks]
    assert len(set(got)) == len(got)


def test_large_words_wrap_exactly() -> None:
    # Words near +-2^31 times weights near 2^16 overflow int32 products and int64 sums'
    # intermediate ranges: only the low 32 bits may count, and they must be exact.
    k = torch.full(SHAPE, -(2**31), dtype=torch.int32).view(torch.float32)
    v = torch.full(SHAPE, 2**31 - 1, dtype=torch.int32).view(torch.float32)
    ids = list(range(SHAPE[0]))  # 2,560 words a side: weights up to 2,561
    assert chunk_checksums([(k, v, torch.tensor(ids))]) == [reference(k, v, ids)]


def test_a_flipped_bit_or_a_swapped_block_changes_the_value() -> None:
    k, v = pools(1, torch.bfloat16)
    ids = [5, 9, 2]
    before = chunk_checksums([(k, v, torch.tensor(ids))])[0]
    swapped = chunk_checksums([(k, v, torch.tensor([9, 5, 2]))])[0]
    v[2].view(torch.int16)[0, 0, 0] ^= 1
    after = chunk_checksums([(k, v, torch.tensor(ids))])[0]
    assert len({before, swapped, after}) == 3
    assert chunk_checksums([]) == []
