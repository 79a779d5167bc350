"""cuda-ipc's device checksum (mili.kv_handoff.cuda_ipc.chunk_checksums), on the CPU: plain
torch, so the definition is checked here against Python integers; the GPU check runs the
transport itself (tests/prefill/test_cuda_ipc.py, -m gpu)."""

from __future__ import annotations

import random

import pytest
import torch

from mili.kv_handoff import cuda_ipc
from mili.kv_handoff.cuda_ipc import chunk_checksums

# [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]: 64 float32 words a block
SHAPE = (4, 2, 40, 4, 2, 8)


def reference(blocks: torch.Tensor, layer: int, ids: list[int]) -> int:
    """The documented value of one layer's chunk, in Python integers: sum(x * (p % 65521 + 1
    + side)) over each side's 32-bit words, K's times 31 plus V's, modulo 2^32."""
    total = 0
    for side in (0, 1):
        words = blocks[layer, side][ids].reshape(-1).view(torch.int32).tolist()
        side_sum = sum(x * (p % 65521 + 1 + side) for p, x in enumerate(words))
        total = total * 31 + side_sum
    return total & 0xFFFFFFFF


def pool(seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).mul(1e3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_layer_of_each_run_gets_the_documented_value(dtype: torch.dtype) -> None:
    rng = random.Random(7)
    blocks = pool(0, dtype)
    runs = []  # (first layer, number of layers, block ids)
    for first, count in ((0, 4), (2, 1), (1, 2)):
        ids = rng.sample(range(SHAPE[2]), rng.randint(1, 9))  # scattered, as a free list gives
        runs.append((first, count, ids))
    got = chunk_checksums(
        [(blocks[first : first + count], torch.tensor(ids)) for first, count, ids in runs]
    )
    expected = [
        reference(blocks, layer, ids)
        for first, count, ids in runs
        for layer in range(first, first + count)
    ]
    assert got == expected
    assert len(set(got)) == len(got)


def test_large_words_wrap_exactly() -> None:
    # Words near +-2^31 times weights up to 2,561 overflow int32 products: only the low 32
    # bits may count, and they must be exact.
    blocks = torch.empty(SHAPE, dtype=torch.float32)
    blocks[:, 0].view(torch.int32).fill_(-(2**31))
    blocks[:, 1].view(torch.int32).fill_(2**31 - 1)
    ids = list(range(SHAPE[2]))  # 2,560 words a side
    got = chunk_checksums([(blocks[1:3], torch.tensor(ids))])
    assert got == [reference(blocks, layer, ids) for layer in (1, 2)]


def test_a_flipped_bit_or_a_swapped_block_changes_the_value() -> None:
    blocks = pool(1, torch.bfloat16)
    ids = [5, 9, 2]
    before = chunk_checksums([(blocks[:1], torch.tensor(ids))])[0]
    swapped = chunk_checksums([(blocks[:1], torch.tensor([9, 5, 2]))])[0]
    blocks[0, 1, 2].view(torch.int16)[0, 0, 0] ^= 1
    after = chunk_checksums([(blocks[:1], torch.tensor(ids))])[0]
    assert len({before, swapped, after}) == 3
    assert chunk_checksums([]) == []


def test_a_run_larger_than_one_pass_is_checked_in_passes_to_the_same_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blocks = pool(2, torch.bfloat16)
    ids = torch.tensor([3, 1, 4, 15, 9])
    whole = chunk_checksums([(blocks, ids)])
    layer_bytes = 2 * 5 * blocks[0, 0, 0].numel() * blocks.element_size()
    monkeypatch.setattr(cuda_ipc, "_MAX_RUN_BYTES", layer_bytes + 1)  # one layer a pass
    assert chunk_checksums([(blocks, ids)]) == whole
    assert whole == [reference(blocks, layer, ids.tolist()) for layer in range(SHAPE[0])]


def test_the_senders_checksums_of_its_gathers_equal_the_blocks_once_copied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prefill checksums the KV it copies (kv_checksums), decode its blocks (chunk_checksums):
    # the same KV must give the same values, in one pass or in passes of a layer.
    blocks = pool(3, torch.bfloat16)
    ids = torch.tensor([7, 0, 31, 12])
    gathered = [blocks[:3].index_select(2, ids), blocks[3:].index_select(2, ids[:2])]
    expected = [reference(blocks, layer, ids.tolist()) for layer in range(3)]
    expected += [reference(blocks, 3, ids[:2].tolist())]
    assert cuda_ipc.kv_checksums(gathered) == expected
    assert chunk_checksums([(blocks[:3], ids), (blocks[3:], ids[:2])]) == expected
    layer_bytes = gathered[0][0].numel() * blocks.element_size()
    monkeypatch.setattr(cuda_ipc, "_MAX_RUN_BYTES", layer_bytes + 1)
    assert cuda_ipc.kv_checksums(gathered) == expected
