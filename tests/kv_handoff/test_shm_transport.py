"""ShmTransport: prefill's side of an shm transfer (encode) writes the blocks into decode's pool
bit for bit, announces the checksum decode will read back from them, and refuses blocks that do
not fit before writing anything; decode's side (land) accepts exactly what was written."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mili.engine.kv.kv_layout import KVLayout
from mili.engine.model.kv_cache import pool_bytes, pool_views
from mili.errors import DataLoss
from mili.kv_handoff import checksums, codec
from mili.kv_handoff.block_rows import block_rows
from mili.kv_handoff.shm_segment import Segment
from mili.kv_handoff.transport import ShmTransport

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
NUM_BLOCKS = 16
DTYPE = torch.bfloat16


@pytest.fixture
def segment(tmp_path: Path) -> Iterator[Segment]:
    segment = Segment.create(pool_bytes(LAYOUT, NUM_BLOCKS, DTYPE), directory=tmp_path)
    yield segment
    segment.close()


def _blocks(n: int, seed: int) -> torch.Tensor:
    shape = (n, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    # Random bit patterns (NaN payloads included): the copy must not touch a bit.
    bits = torch.randint(-(2**15), 2**15, shape, generator=torch.Generator().manual_seed(seed))
    return bits.to(torch.int16).view(DTYPE)


def test_encode_of_no_blocks_writes_nothing(segment: Segment) -> None:
    pool = ShmTransport(segment, LAYOUT, NUM_BLOCKS, DTYPE)
    message, num_bytes = pool.encode("r", 0, 2, [], _blocks(0, 5), _blocks(0, 6))
    chunk = codec.parse_transfer_request(message)
    assert isinstance(chunk, codec.ChunkView)
    assert (num_bytes, chunk.layer, chunk.block_ids) == (0, 2, [])
    assert not segment.tensor.any()


@pytest.mark.parametrize("checksum", checksums.available())
@pytest.mark.parametrize("ids", [[5, 6, 7, 8], [9, 2, 14], [3, 4, 5, 6, 7, 8, 9, 10, 0]])
def test_encode_writes_the_blocks_and_announces_what_decode_reads(
    segment: Segment, checksum: str, ids: list[int]
) -> None:
    pool = ShmTransport(segment, LAYOUT, NUM_BLOCKS, DTYPE)
    k, v = _blocks(len(ids), 1), _blocks(len(ids), 2)
    message, num_bytes = pool.encode("r", 3, 1, ids, k, v, checksum)
    assert num_bytes == k.nbytes + v.nbytes
    # Decode's view of the same memory: its own mapping of the segment.
    decode_k, decode_v = pool_views(segment.tensor, LAYOUT, NUM_BLOCKS, DTYPE)
    for pool_blocks, sent in ((decode_k[1], k), (decode_v[1], v)):
        assert torch.equal(pool_blocks[ids].view(torch.int16), sent.view(torch.int16))
    untouched = [b for b in range(NUM_BLOCKS) if b not in ids]
    assert not decode_k[1][untouched].view(torch.int16).any()
    assert not any(t.view(torch.int16).any() for t in (decode_k[0], decode_v[2]))
    chunk = codec.parse_transfer_request(message)
    assert isinstance(chunk, codec.ChunkView)
    assert (chunk.seq, chunk.layer, chunk.block_ids, len(chunk.data)) == (3, 1, ids, 0)
    rows = block_rows(decode_k[1]), block_rows(decode_v[1])
    read_back = codec.rows_digest(checksum, *rows, ids)
    assert codec.announced(chunk, checksum) == read_back
    decode_k[1][ids[-1]].view(torch.uint8)[0, 0, 0] ^= 1  # a bit a bad write would leave
    assert codec.rows_digest(checksum, *rows, ids) != read_back


@pytest.mark.parametrize(
    "case",
    ["wrong dtype", "wrong block shape", "more blocks than ids", "id out of range", "negative id"],
)
def test_encode_refuses_blocks_that_do_not_fit_and_writes_nothing(
    segment: Segment, case: str
) -> None:
    pool = ShmTransport(segment, LAYOUT, NUM_BLOCKS, DTYPE)
    ids = [1, 2]
    k, v = _blocks(2, 3), _blocks(2, 4)
    if case == "wrong dtype":
        k = k.float()
    elif case == "wrong block shape":
        v = v.reshape(2, LAYOUT.block_size, 1, 2 * LAYOUT.head_dim)
    elif case == "more blocks than ids":
        ids = [1]
    elif case == "id out of range":
        ids = [1, NUM_BLOCKS]
    else:
        ids = [-1, 2]
    with pytest.raises(ValueError, match="do not fit decode's pool"):
        pool.encode("r", 0, 0, ids, k, v)
    assert not segment.tensor.any()


@pytest.mark.parametrize("checksum", checksums.available())
def test_land_accepts_what_encode_wrote_and_refuses_blocks_changed_since(
    segment: Segment, checksum: str
) -> None:
    sender = ShmTransport(segment, LAYOUT, NUM_BLOCKS, DTYPE)
    receiver = ShmTransport(segment, LAYOUT, NUM_BLOCKS, DTYPE)  # decode's own view of the pool
    ids = [7, 3, 4]
    message, _ = sender.encode("r", 0, 2, ids, _blocks(3, 1), _blocks(3, 2), checksum)
    chunk = codec.parse_transfer_request(message)
    assert isinstance(chunk, codec.ChunkView)
    receiver.land(chunk, checksum)
    receiver.v[2][3].view(torch.int16)[0, 0, 0] ^= 1  # one bit of a block flipped in place
    with pytest.raises(DataLoss, match="checksum mismatch"):
        receiver.land(chunk, checksum)
