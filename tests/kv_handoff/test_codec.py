"""KV chunks survive the wire bit for bit, and every kind of damage is DATA_LOSS."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from google.protobuf.message import DecodeError

from mili.engine.kv.kv_layout import KVLayout
from mili.errors import DataLoss
from mili.kv_handoff import checksums, codec
from mili.kv_handoff.block_rows import block_rows, block_runs
from mili.pb.common.v1 import sampling_pb2
from mili.pb.kv.v1 import kv_pb2
from mili.rpc import kv_layout

LAYOUT = KVLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=32, dtype="bfloat16")


def _chunk(
    request_id: str, seq: int, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor
) -> kv_pb2.KvChunk:
    """The chunk `encode_chunk_request` sends, parsed by protobuf."""
    message, _ = codec.encode_chunk_request(request_id, seq, layer, block_ids, k, v)
    return kv_pb2.TransferKvRequest.FromString(message).chunk


def _blocks(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    shape = (n, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [0, 1, 5])
def test_round_trip_is_bit_exact(dtype: torch.dtype, n: int) -> None:
    layout = kv_layout.layout_to_proto(LAYOUT._replace(dtype=str(dtype)[6:]), "fp")
    k, v = _blocks(n, dtype)
    chunk = _chunk("req-1", 3, 2, list(range(10, 10 + n)), k, v)
    assert len(chunk.data) == 2 * n * kv_layout.block_bytes(layout)
    k2, v2 = codec.decode_chunk(chunk, layout)
    assert k2.dtype == dtype and torch.equal(k2, k) and torch.equal(v2, v)


def test_corrupt_short_and_misplaced_chunks_are_data_loss() -> None:
    layout = kv_layout.layout_to_proto(LAYOUT, "fp")
    k, v = _blocks(2, torch.bfloat16)
    chunk = _chunk("req-9", 7, 1, [4, 5], k, v)

    flipped = type(chunk)()
    flipped.CopyFrom(chunk)
    flipped.data = bytes([chunk.data[0] ^ 1]) + chunk.data[1:]
    with pytest.raises(DataLoss, match=r"request 'req-9' chunk 7 \(layer 1\): checksum"):
        codec.decode_chunk(flipped, layout)

    short = type(chunk)()
    short.CopyFrom(chunk)
    short.data = chunk.data[:-2]
    with pytest.raises(DataLoss, match="bytes for 2 blocks"):
        codec.decode_chunk(short, layout)

    misplaced = type(chunk)()
    misplaced.CopyFrom(chunk)
    misplaced.layer = LAYOUT.num_layers
    with pytest.raises(DataLoss, match="layer out of range"):
        codec.decode_chunk(misplaced, layout)


# ---- the chunk message on the wire: both ends against protobuf -----------------------------------

ENCODINGS = [
    ("r", 0, 0, [0]),  # zero-valued fields are not written
    ("req-é", 1, 27, [5, 3, 200, 70000]),  # non-ASCII id, multi-byte varints
    ("x" * 300, 130, 128, list(range(40))),  # a length prefix of two bytes
    ("", 0, 0, []),  # every field at its default: an empty KvChunk
]


def _protobuf_chunk(
    request_id: str, seq: int, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor
) -> kv_pb2.KvChunk:
    """The reference: the chunk built the generic way, through protobuf."""
    data = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in (k, v))
    return kv_pb2.KvChunk(
        request_id=request_id,
        seq=seq,
        layer=layer,
        block_ids=block_ids,
        data=data,
        # the place, bound in: seq, layer, block ids as little-endian uint64s
        crc32=zlib.crc32(struct.pack(f"<{2 + len(block_ids)}Q", seq, layer, *block_ids) + data),
    )


def _kv(n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, 4, 2, 8)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _fields(chunk: kv_pb2.KvChunk | codec.ChunkView) -> tuple[object, ...]:
    return (
        chunk.request_id,
        chunk.seq,
        chunk.layer,
        list(chunk.block_ids),
        bytes(chunk.data),
        chunk.crc32,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("request_id", "seq", "layer", "block_ids"), ENCODINGS)
def test_encoder_writes_the_bytes_protobuf_writes(
    dtype: torch.dtype, request_id: str, seq: int, layer: int, block_ids: list[int]
) -> None:
    k, v = _kv(len(block_ids), dtype, seed=seq)
    message, num_data = codec.encode_chunk_request(request_id, seq, layer, block_ids, k, v)
    reference = _protobuf_chunk(request_id, seq, layer, block_ids, k, v)
    assert message == kv_pb2.TransferKvRequest(chunk=reference).SerializeToString()
    assert num_data == len(reference.data)
    assert _chunk(request_id, seq, layer, block_ids, k, v) == reference


def test_encoder_writes_non_contiguous_input_in_c_order() -> None:
    k = torch.arange(2 * 4 * 2 * 8, dtype=torch.float32).reshape(2, 8, 2, 4).transpose(1, 3)
    v = k + 1
    message, _ = codec.encode_chunk_request("r", 1, 1, [0, 1], k, v)
    reference = _protobuf_chunk("r", 1, 1, [0, 1], k, v)
    assert message == kv_pb2.TransferKvRequest(chunk=reference).SerializeToString()


def test_encoder_refuses_a_shape_mismatch() -> None:
    k = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match="block ids"):
        codec.encode_chunk_request("r", 0, 0, [0], k, k)


@pytest.mark.parametrize(("request_id", "seq", "layer", "block_ids"), ENCODINGS)
def test_parser_reads_what_protobuf_reads_and_copies_no_data(
    request_id: str, seq: int, layer: int, block_ids: list[int]
) -> None:
    k, v = _kv(len(block_ids), torch.bfloat16)
    raw, _ = codec.encode_chunk_request(request_id, seq, layer, block_ids, k, v)
    view = codec.parse_transfer_request(raw)
    assert isinstance(view, codec.ChunkView)
    assert _fields(view) == _fields(kv_pb2.TransferKvRequest.FromString(raw).chunk)
    assert view.data.obj is raw  # a view of grpc's bytes, not a copy


def _key(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def _len(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _chunk_message(body: bytes) -> bytes:
    return _len(2, body)


# Encodings protobuf accepts but never writes itself: the parser must read them the same way.
UNUSUAL = {
    "fields-reversed": [
        _key(6, 0) + _varint(77),
        _len(5, b"abcd"),
        _len(4, b"\x01\x02"),
        _key(3, 0) + _varint(2),
        _key(2, 0) + _varint(9),
        _len(1, b"req"),
    ],
    "unpacked-block-ids": [_key(4, 0) + b"\x07", _len(4, b"\x08\x09"), _key(4, 0) + b"\x0a"],
    "last-one-wins": [
        _key(2, 0) + b"\x01",
        _key(2, 0) + b"\x02",
        _len(5, b"x"),
        _len(5, b"yz"),
        _len(1, b"a"),
        _len(1, b"b"),
    ],
    "unknown-fields": [
        _key(7, 0) + _varint(1 << 40),
        _key(8, 1) + bytes(8),
        _len(9, b"??"),
        _key(10, 5) + bytes(4),
        _len(1, b"id"),
    ],
    "uint32-truncation": [_key(2, 0) + _varint((1 << 35) + 5), _key(6, 0) + _varint(1 << 32)],
    "default-values-written": [_len(1, b""), _key(2, 0) + b"\x00", _len(5, b"")],
}


@pytest.mark.parametrize("case", list(UNUSUAL))
def test_parser_reads_unusual_encodings_as_protobuf_does(case: str) -> None:
    raw = _chunk_message(b"".join(UNUSUAL[case]))
    view = codec.parse_transfer_request(raw)
    assert isinstance(view, codec.ChunkView)
    assert _fields(view) == _fields(kv_pb2.TransferKvRequest.FromString(raw).chunk)


def test_parser_leaves_other_messages_to_protobuf() -> None:
    header = kv_pb2.TransferKvRequest(header=kv_pb2.TransferHeader(request_id="h", num_chunks=3))
    commit = kv_pb2.TransferKvRequest(commit=kv_pb2.TransferCommit(first_token_id=5))
    for message in (header, commit, kv_pb2.TransferKvRequest()):
        parsed = codec.parse_transfer_request(message.SerializeToString())
        assert isinstance(parsed, kv_pb2.TransferKvRequest) and parsed == message
    # Two chunk fields merge (protobuf's rule for a repeated message field): left to protobuf.
    twice = _chunk_message(_len(1, b"a") + _len(5, b"xy")) + _chunk_message(_key(2, 0) + b"\x04")
    parsed = codec.parse_transfer_request(twice)
    assert isinstance(parsed, kv_pb2.TransferKvRequest)
    assert (parsed.chunk.request_id, parsed.chunk.data, parsed.chunk.seq) == ("a", b"xy", 4)


@pytest.mark.parametrize(
    "raw",
    [
        _chunk_message(_len(5, b"abc"))[:-1],  # truncated
        _chunk_message(_len(1, b"\xff\xfe")),  # request_id not UTF-8
        _chunk_message(_key(2, 0) + b"\xff" * 11),  # varint too long
        _chunk_message(_key(0, 0) + b"\x01"),  # field number 0
        _chunk_message(_key(4, 2) + b"\x02\x80\x80"),  # packed varint runs past its field
    ],
)
def test_parser_leaves_malformed_input_to_protobuf(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        codec.parse_transfer_request(raw)


def test_decode_chunk_reads_a_view_as_it_reads_a_message() -> None:
    layout = kv_layout.layout_to_proto(LAYOUT, "fp")
    k, v = _blocks(3, torch.bfloat16)
    raw, _ = codec.encode_chunk_request("req-3", 4, 2, [7, 8, 9], k, v)
    view = codec.parse_transfer_request(raw)
    assert isinstance(view, codec.ChunkView)
    k2, v2 = codec.decode_chunk(view, layout)
    assert torch.equal(k2, k) and torch.equal(v2, v)

    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 1
    view = codec.parse_transfer_request(bytes(flipped))
    assert isinstance(view, codec.ChunkView)
    with pytest.raises(DataLoss, match=r"request 'req-3' chunk 4 \(layer 2\): checksum"):
        codec.decode_chunk(view, layout)
    with pytest.raises(DataLoss, match="bytes for 3 blocks"):
        codec.decode_chunk(view._replace(data=view.data[:-2]), layout)


# ---- checksums chosen per pair, and blocks written in place ---------------------------------


def test_xxh3_chunks_are_what_protobuf_writes_and_reads_and_catch_corruption() -> None:
    xxhash = pytest.importorskip("xxhash")
    layout = kv_layout.layout_to_proto(LAYOUT, "fp")
    k, v = _blocks(3, torch.bfloat16)
    raw, _ = codec.encode_chunk_request("r", 2, 1, [7, 8, 9], k, v, "xxh3-64")
    reference = _protobuf_chunk("r", 2, 1, [7, 8, 9], k, v)
    reference.crc32 = 0
    place = struct.pack("<5Q", 2, 1, 7, 8, 9)
    reference.xxh3_64 = xxhash.xxh3_64_intdigest(place + reference.data)
    assert raw == kv_pb2.TransferKvRequest(chunk=reference).SerializeToString()
    view = codec.parse_transfer_request(raw)
    assert isinstance(view, codec.ChunkView) and view.xxh3_64 == reference.xxh3_64
    k2, _ = codec.decode_chunk(view, layout, "xxh3-64")
    assert torch.equal(k2, k)
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 1
    with pytest.raises(DataLoss, match="checksum"):
        codec.decode_chunk(codec.parse_transfer_request(bytes(flipped)), layout, "xxh3-64")
    with pytest.raises(DataLoss, match="checksum"):  # read as the wrong checksum: caught too
        codec.decode_chunk(view, layout, "crc32")
    with pytest.raises(DataLoss, match="checksum"):  # labelled with another layer
        codec.decode_chunk(view._replace(layer=0), layout, "xxh3-64")


@pytest.mark.parametrize("checksum", checksums.available())
def test_rows_digest_is_the_digest_of_the_chunk_those_blocks_would_make(checksum: str) -> None:
    """An in-place chunk's checksum (blocks as the pool holds them, runs of consecutive ids
    read at once) equals the checksum of the bytes those blocks would make as data (in place,
    both ends read the same places: no label is bound in)."""
    k_pool, v_pool = _blocks(12, torch.float16)
    block_ids = [3, 4, 5, 9, 1, 2]
    k, v = k_pool[block_ids], v_pool[block_ids]
    rows = block_rows(k_pool), block_rows(v_pool)
    value = codec.rows_digest(checksum, *rows, block_ids)
    assert value == checksums.digest(checksum, [codec.raw_bytes(k), codec.raw_bytes(v)]) != 0
    assert codec.rows_digest(checksum, *rows, [4, 3, 5, 9, 1, 2]) != value
    in_place = codec.parse_transfer_request(
        codec.encode_chunk_in_place("r", 0, 0, block_ids, value, checksum)
    )
    assert isinstance(in_place, codec.ChunkView) and len(in_place.data) == 0
    assert codec.announced(in_place, checksum) == value
    assert block_runs(block_ids) == [(3, 6), (9, 10), (1, 3)]


def test_checksum_choice_takes_the_first_offered_we_have() -> None:
    assert checksums.choose(["sha-9000", "crc32"]) == "crc32"
    assert checksums.choose([]) == "crc32"
    assert checksums.choose(checksums.available()) == checksums.available()[0]
    with pytest.raises(ValueError, match="not available"):
        checksums.digest("sha-9000", [b""])


@pytest.mark.parametrize("checksum", checksums.available())
def test_running_digest_is_the_digest_however_the_bytes_are_split(checksum: str) -> None:
    data = bytes(range(256)) * 97
    whole = checksums.digest(checksum, [data])
    assert checksums.digest(checksum, (data,)) == whole  # xxh3: the one-shot function
    assert whole == (zlib.crc32(data) if checksum == checksums.CRC32 else whole) != 0
    for cuts in ([], [1], [100, 101, 5000], [len(data) - 1]):
        running = checksums.Running(checksum)
        for start, stop in zip([0, *cuts], [*cuts, len(data)], strict=True):
            running.update(memoryview(data)[start:stop])
        assert running.value() == whole
    running = checksums.Running(checksum)
    running.update(data[:-1] + b"\x00")
    assert running.value() != whole
    with pytest.raises(ValueError, match="not available"):
        checksums.Running("sha-9000")


def test_chunk_batches_are_what_protobuf_writes() -> None:
    """batch_in_place joins in-place chunk messages into one TransferKvRequest.chunks, byte for
    byte as protobuf would serialize it, and refuses anything but lone chunk messages."""
    messages = [
        codec.encode_chunk_in_place(f"req-{i}", seq, seq % 4, [seq, 300 + seq], seq * 7919)
        for i, seq in enumerate([0, 1, 2, 200])
    ]
    batch = codec.batch_in_place(messages)
    chunks = [kv_pb2.TransferKvRequest.FromString(m).chunk for m in messages]
    expected = kv_pb2.TransferKvRequest(chunks=kv_pb2.KvChunks(chunks=chunks))
    assert batch == expected.SerializeToString()
    parsed = codec.parse_transfer_request(batch)
    assert isinstance(parsed, kv_pb2.TransferKvRequest) and parsed.WhichOneof("kind") == "chunks"
    assert list(parsed.chunks.chunks) == chunks
    assert (
        codec.batch_in_place(messages[:1])
        == kv_pb2.TransferKvRequest(chunks=kv_pb2.KvChunks(chunks=chunks[:1])).SerializeToString()
    )
    # The commit rides after the chunks: one message ends an in-place transfer.
    commit = kv_pb2.TransferCommit(
        first_token_id=151_643,
        first_logprobs=sampling_pb2.Logprobs(chosen=sampling_pb2.TokenLogprob(token_id=151_643)),
    )
    with_commit = kv_pb2.TransferKvRequest(chunks=kv_pb2.KvChunks(chunks=chunks, commit=commit))
    assert codec.batch_in_place(messages, commit) == with_commit.SerializeToString()
    parsed = codec.parse_transfer_request(codec.batch_in_place(messages, commit))
    assert isinstance(parsed, kv_pb2.TransferKvRequest) and parsed.chunks.commit == commit
    assert not expected.chunks.HasField("commit")
    header = kv_pb2.TransferKvRequest(header=kv_pb2.TransferHeader(request_id="r"))
    with pytest.raises(ValueError, match="not a serialized"):
        codec.batch_in_place([header.SerializeToString()])
    with pytest.raises(ValueError, match="more than its chunk"):
        codec.batch_in_place([messages[0] + b"\x18\x01"])
