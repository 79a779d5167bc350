"""A KV chunk straight to the bytes of a serialized `TransferKvRequest{chunk: KvChunk}`.

Byte for byte what `TransferKvRequest(chunk=kv_codec.encode_chunk(...)).SerializeToString()`
gives (tests/prefill/test_wire.py checks it), with one copy of the KV instead of five: the
generic path copies K and V out of the tensors, concatenates them, copies them into the KvChunk,
again into the TransferKvRequest, and again when serializing. Here K and V stay memoryviews of
the tensors until one `bytes.join` writes the whole message, and the CRC-32 runs over them in
place. At ~2 MB per layer this is what keeps the encoder from being the KV path's bottleneck.

Protobuf wire format used (proto3: a field at its default value is not written):

    TransferKvRequest  0x12 len  KvChunk                      (field 2, length-delimited)
    KvChunk            0x0a len request_id                    (1, string)
                       0x10 seq | 0x18 layer                  (2, 3: varints)
                       0x22 len packed block_ids              (4, packed varints)
                       0x2a len K bytes V bytes               (5, bytes)
                       0x30 crc32                             (6, varint)
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    return bytes([tag]) + _varint(len(payload)) + payload


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order, little-endian as torch stores them; no copy when it is
    already a contiguous CPU tensor."""
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy().data)


def chunk_request(
    request_id: str,
    seq: int,
    layer: int,
    block_ids: Sequence[int],
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[bytes, int]:
    """(serialized TransferKvRequest, payload bytes); k, v: [len(block_ids), block_size, ...]."""
    if k.shape != v.shape or k.shape[0] != len(block_ids):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} vs {len(block_ids)} block ids")
    k_bytes, v_bytes = _raw(k), _raw(v)
    num_data = len(k_bytes) + len(v_bytes)
    crc = zlib.crc32(v_bytes, zlib.crc32(k_bytes))
    head = bytearray()
    if request_id:
        head += _field(0x0A, request_id.encode())
    if seq:
        head += b"\x10" + _varint(seq)
    if layer:
        head += b"\x18" + _varint(layer)
    if block_ids:
        head += _field(0x22, b"".join(_varint(b) for b in block_ids))
    if num_data:
        head += b"\x2a" + _varint(num_data)
    tail = b"\x30" + _varint(crc) if crc else b""
    body = len(head) + num_data + len(tail)
    message = b"".join((b"\x12", _varint(body), head, k_bytes, v_bytes, tail))
    return message, num_data
