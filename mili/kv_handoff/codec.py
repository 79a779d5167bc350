"""KV blocks on the wire: KvChunk encode/decode with CRC-32 (tensors <-> bytes).

One chunk carries the K and V of some whole blocks of one layer (see protos/mili/kv/v1/kv.proto):

    data = bytes(K) + bytes(V), each a C-order [n_blocks, block_size, num_kv_heads, head_dim]
           tensor of the layout's dtype (little-endian, as torch stores it on x86/ARM and CUDA)
    crc32 = zlib.crc32(label + data)   (or, when the pair chose it, xxh3_64 = XXH3-64 of the
                                        same: see mili.kv_handoff.checksums)
    label = seq, layer, block_ids as little-endian uint64s: the chunk's place, bound into its
            checksum, so a chunk labelled with another layer or block order fails it (the
            transfer's bookkeeping sees only that each place came once)

The layout both sides agree on first (KvLayout, `check_compatible`, `block_bytes`) is
`mili.rpc.kv_layout`'s, which needs no torch: the frontend imports that one, never this.

Chunks are megabytes each, so both ends handle the serialized `TransferKvRequest{chunk}` bytes
themselves rather than through protobuf objects, which copy the data at every step:

    prefill   encode_chunk_request  K, V -> message bytes: one copy (the final join), CRC-32 over
                                    the tensors in place
    decode    parse_transfer_request  message bytes -> ChunkView: data a view of those bytes
              decode_chunk          length and CRC-32 checks; K, V as views of the same bytes

Both write and read exactly the protobuf wire format (tests/kv_handoff/test_codec.py checks them
against protobuf byte for byte and field for field), so either end may use protobuf instead.
Wire format of a chunk message (proto3: a field at its default value is not written):

    TransferKvRequest  0x12 len  KvChunk                      (field 2, length-delimited)
    KvChunk            0x0a len request_id                    (1, string)
                       0x10 seq | 0x18 layer                  (2, 3: varints)
                       0x22 len packed block_ids              (4, packed varints)
                       0x2a len K bytes V bytes               (5, bytes)
                       0x30 crc32                             (6, varint)
                       0x38 xxh3_64                           (7, varint)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from mili.engine.model.kv_cache import TORCH_DTYPES
from mili.errors import DataLoss, FailedPrecondition
from mili.kv_handoff.block_rows import block_runs
from mili.kv_handoff.checksums import CRC32, digest
from mili.pb.kv.v1 import kv_pb2
from mili.rpc.kv_layout import block_bytes


def torch_dtype(layout: kv_pb2.KvLayout) -> torch.dtype:
    try:
        return TORCH_DTYPES[layout.dtype]
    except KeyError:
        raise FailedPrecondition(f"unsupported KV dtype {layout.dtype!r}") from None


# ---- encoding (prefill) -----------------------------------------------------------------------


def _write_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def label(seq: int, layer: int, block_ids: Sequence[int]) -> bytes:
    """A chunk's place in its transfer, as its checksum covers it (see the module docstring)."""
    return np.array([seq, layer, *block_ids], dtype="<u8").tobytes()


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order, little-endian as torch stores them; no copy when it is
    already a contiguous CPU tensor. (A uint8 view: numpy has no bf16.)"""
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy().data)


def encode_chunk_request(
    request_id: str,
    seq: int,
    layer: int,
    block_ids: Sequence[int],
    k: torch.Tensor,
    v: torch.Tensor,
    checksum: str = CRC32,
) -> tuple[bytes, int]:
    """(serialized `TransferKvRequest{chunk}`, payload bytes); k, v: [len(block_ids),
    block_size, num_kv_heads, head_dim] of the cache's dtype; `checksum`: a name from checksums.

    One copy of the KV instead of protobuf's five (out of the tensors, their concatenation, into
    the KvChunk, into the TransferKvRequest, serializing): K and V stay views of the tensors
    until one `bytes.join` writes the whole message, and the CRC-32 runs over them in place
    (zlib releases the GIL on large buffers: run this on an encoder thread).
    """
    if k.shape != v.shape or k.shape[0] != len(block_ids):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} vs {len(block_ids)} block ids")
    k_bytes, v_bytes = raw_bytes(k), raw_bytes(v)
    num_data = len(k_bytes) + len(v_bytes)
    value = digest(checksum, (label(seq, layer, block_ids), k_bytes, v_bytes))
    head = bytearray()
    if request_id:
        encoded_id = request_id.encode()
        head += b"\x0a" + _write_varint(len(encoded_id)) + encoded_id
    if seq:
        head += b"\x10" + _write_varint(seq)
    if layer:
        head += b"\x18" + _write_varint(layer)
    if block_ids:
        packed = b"".join(_write_varint(b) for b in block_ids)
        head += b"\x22" + _write_varint(len(packed)) + packed
    if num_data:
        head += b"\x2a" + _write_varint(num_data)
    tail = b""
    if value:
        tail = (b"\x30" if checksum == CRC32 else b"\x38") + _write_varint(value)
    body = len(head) + num_data + len(tail)
    message = b"".join((b"\x12", _write_varint(body), head, k_bytes, v_bytes, tail))
    return message, num_data


# ---- decoding (decode) -------------------------------------------------------------------------


class ChunkView(NamedTuple):
    """A KvChunk read in place from a serialized `TransferKvRequest{chunk}`: `data` is a view of
    the message's bytes, not a copy (see `parse_transfer_request`)."""

    request_id: str
    seq: int
    layer: int
    block_ids: list[int]
    data: memoryview
    crc32: int
    xxh3_64: int = 0


def parse_transfer_request(raw: bytes) -> kv_pb2.TransferKvRequest | ChunkView:
    """The request deserializer of TransferKv's receiving end: a chunk comes back as a
    ChunkView, its megabytes left where grpc put them; anything else (the header, the commit)
    as protobuf parses it. Reading the chunk through protobuf costs two copies of its data: one
    when parsing the message, one when reading its `data` field.

    Reads any encoding protobuf writes or accepts, field for field as protobuf would; a message
    it does not read itself (a repeated `chunk` field, a group, a malformed one) goes to
    protobuf, which also raises the DecodeError for bad input.
    """
    chunk = _parse_chunk(raw)
    return chunk if chunk is not None else kv_pb2.TransferKvRequest.FromString(raw)


_UINT32 = 0xFFFFFFFF  # protobuf keeps the low 32 bits of a varint read into a uint32 field
_UINT64 = (1 << 64) - 1


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it); ValueError past the end or beyond 10 bytes."""
    value = shift = 0
    while True:
        byte = buf[pos]  # IndexError past the end
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise ValueError("varint longer than 10 bytes")


def _parse_chunk(raw: bytes) -> ChunkView | None:
    """A TransferKvRequest made of exactly one `chunk` field, as a ChunkView; else None."""
    try:
        if not raw or raw[0] != 0x12:  # field 2 (chunk), length-delimited
            return None
        size, pos = _read_varint(raw, 1)
        end = len(raw)
        if pos + size != end:  # more fields follow (or too few bytes): protobuf's to merge
            return None
        request_id = b""
        seq = layer = crc32 = xxh3_64 = 0
        block_ids: list[int] = []
        data = memoryview(raw)[0:0]
        while pos < end:
            key, pos = _read_varint(raw, pos)
            field, wire_type = key >> 3, key & 7
            if wire_type == 0:  # varint
                value, pos = _read_varint(raw, pos)
                if field in (0, 1, 5):
                    return None  # no field 0; a string or bytes as a varint: protobuf's call
                if field == 2:
                    seq = value & _UINT32
                elif field == 3:
                    layer = value & _UINT32
                elif field == 4:  # an unpacked repeated uint32
                    block_ids.append(value & _UINT32)
                elif field == 6:
                    crc32 = value & _UINT32
                elif field == 7:
                    xxh3_64 = value & _UINT64
            elif wire_type == 2:  # length-delimited
                size, pos = _read_varint(raw, pos)
                if pos + size > end:
                    return None
                if field == 1:
                    request_id = raw[pos : pos + size]
                elif field == 4:  # packed uint32s
                    packed, stop = pos, pos + size
                    while packed < stop:
                        value, packed = _read_varint(raw, packed)
                        block_ids.append(value & _UINT32)
                    if packed != stop:
                        return None
                elif field == 5:
                    data = memoryview(raw)[pos : pos + size]
                elif field in (0, 2, 3, 6, 7):
                    return None  # no field 0; a scalar sent length-delimited: protobuf's call
                pos += size
            elif wire_type == 1 and field > 7:
                pos += 8  # unknown fixed64
            elif wire_type == 5 and field > 7:
                pos += 4  # unknown fixed32
            else:
                return None  # groups, reserved wire types, known fields mistyped: protobuf's call
        if pos != end:
            return None
        return ChunkView(request_id.decode(), seq, layer, block_ids, data, crc32, xxh3_64)
    except (IndexError, ValueError):  # truncated; bad varint; request_id not UTF-8
        return None


# A chunk as decode reads it: in place (ChunkView) or, when it came in a batch, as protobuf.
Chunk = kv_pb2.KvChunk | ChunkView


def chunk_name(chunk: Chunk) -> str:
    """A chunk as error messages name it."""
    return f"request {chunk.request_id!r} chunk {chunk.seq} (layer {chunk.layer})"


def announced(chunk: Chunk, checksum: str) -> int:
    """The value of `checksum` the chunk carries."""
    return chunk.crc32 if checksum == CRC32 else chunk.xxh3_64


def decode_chunk(
    chunk: Chunk, layout: kv_pb2.KvLayout, checksum: str = CRC32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a chunk against `layout`; return (k, v), each [n, block_size, kv_heads, D].

    Raises DataLoss naming the request, chunk and layer when the bytes are corrupt or short.
    """
    where = chunk_name(chunk)
    if chunk.layer >= layout.num_layers:
        raise DataLoss(f"{where}: layer out of range (model has {layout.num_layers})")
    n = len(chunk.block_ids)
    data = chunk.data  # each read of a KvChunk's bytes field copies it: read it once
    expected = 2 * n * block_bytes(layout)
    if len(data) != expected:
        raise DataLoss(f"{where}: {len(data)} bytes for {n} blocks, expected {expected}")
    place = label(chunk.seq, chunk.layer, chunk.block_ids)
    if digest(checksum, (place, data)) != announced(chunk, checksum):
        raise DataLoss(f"{where}: checksum mismatch (data or its labels corrupted in transit)")
    shape = (n, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if n == 0:
        empty = torch.empty(shape, dtype=torch_dtype(layout))
        return empty, empty.clone()
    with warnings.catch_warnings():  # bytes are read-only; we only read them (then copy)
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8)
    values = flat.view(torch_dtype(layout))
    half = values.numel() // 2
    return values[:half].view(shape), values[half:].view(shape)


# ---- transports that write the blocks in place (shm, cuda-ipc) -----------------------------

# Initial-metadata key decode sends once it has accepted an in-place transfer's header (the
# transfer token, layout and transport checked, the request's blocks held for the call). The
# sender writes nothing into decode's pool before it: a header decode refuses (a cancelled or
# expired request whose blocks may already belong to another one) must not be preceded by
# bytes landing in those blocks.
ACCEPTED_KEY = "mili-kv-accepted"


def in_place_pools(
    chunk: Chunk, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V pools (of the layers `k`, `v`) an in-place chunk's blocks are in; DataLoss
    for a chunk that is not one."""
    if len(chunk.data):
        raise DataLoss(f"{chunk_name(chunk)}: data sent over gRPC in an in-place transfer")
    if chunk.layer >= len(k):
        raise DataLoss(f"{chunk_name(chunk)}: layer out of range (model has {len(k)})")
    return k[chunk.layer], v[chunk.layer]


def encode_chunk_in_place(
    request_id: str,
    seq: int,
    layer: int,
    block_ids: Sequence[int],
    value: int,
    checksum: str = CRC32,
) -> bytes:
    """A serialized `TransferKvRequest{chunk}` without data: the blocks were written in place,
    `value` (of `checksum`) covers them as `rows_digest` reads them."""
    chunk = kv_pb2.KvChunk(request_id=request_id, seq=seq, layer=layer, block_ids=block_ids)
    if checksum == CRC32:
        chunk.crc32 = value
    else:
        chunk.xxh3_64 = value
    return kv_pb2.TransferKvRequest(chunk=chunk).SerializeToString()


def rows_digest(
    checksum: str, k_rows: np.ndarray, v_rows: np.ndarray, block_ids: Sequence[int]
) -> int:
    """`checksum` of blocks `block_ids` of a layer's K pool, then of its V pool, in that order:
    the bytes a chunk with those blocks would carry. k_rows, v_rows: the pools' byte rows
    ([num_blocks, bytes per block], block_rows), made once by the caller: numpy only, runs of
    consecutive ids read in one piece (no torch call per chunk, each a GIL hand-off on a busy
    landing thread)."""
    runs = block_runs(block_ids)
    return digest(checksum, (r[start:stop].data for r in (k_rows, v_rows) for start, stop in runs))


def batch_in_place(messages: Sequence[bytes], commit: kv_pb2.TransferCommit | None = None) -> bytes:
    """Serialized `TransferKvRequest{chunk}` messages without data (`encode_chunk_in_place`'s)
    -> one serialized `TransferKvRequest{chunks}` holding the same chunks in the same order,
    and the transfer's `commit` after them when given: decode then reads, checks and lands
    them as one message, one landing job.

        TransferKvRequest  0x22 len  KvChunks                 (field 4, length-delimited)
        KvChunks           (0x0a len KvChunk)*                (1, repeated message)
                           [0x12 len TransferCommit]          (2, the commit)
    """
    inner = bytearray()
    for message in messages:
        if not message or message[0] != 0x12:
            raise ValueError("not a serialized TransferKvRequest{chunk}")
        size, pos = _read_varint(message, 1)
        if pos + size != len(message):
            raise ValueError("a TransferKvRequest{chunk} with more than its chunk")
        inner += b"\x0a" + _write_varint(size) + message[pos:]
    if commit is not None:
        serialized = commit.SerializeToString()
        inner += b"\x12" + _write_varint(len(serialized)) + serialized
    return b"\x22" + _write_varint(len(inner)) + bytes(inner)
