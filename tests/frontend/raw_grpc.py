"""A unary gRPC call written by hand over HTTP/2, for headers grpc's own clients never send
(a `grpc-timeout` past what their clocks can add: they fail such a call before sending it).

Plain HTTP/2 with HPACK literals (no Huffman, no table), enough for one call: the reply's
message bytes come back, or None when the call ended without one (an error status).
"""

from __future__ import annotations

import asyncio
import struct

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _SETTINGS = 0, 1, 4
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream_id)
        + payload
    )


def _literal(name: str, value: str) -> bytes:
    """One header as an HPACK literal without indexing, new name (both under 127 bytes)."""
    raw_name, raw_value = name.encode(), value.encode()
    return b"\x00" + bytes([len(raw_name)]) + raw_name + bytes([len(raw_value)]) + raw_value


async def unary(address: str, path: str, request: bytes, headers: dict[str, str]) -> bytes | None:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    block = b"".join(
        _literal(name, value)
        for name, value in {
            ":method": "POST",
            ":scheme": "http",
            ":path": path,
            ":authority": address,
            "content-type": "application/grpc",
            "te": "trailers",
            **headers,
        }.items()
    )
    writer.write(_PREFACE + _frame(_SETTINGS, 0, 0, b""))
    writer.write(_frame(_HEADERS, _END_HEADERS, 1, block))
    writer.write(_frame(_DATA, _END_STREAM, 1, b"\x00" + struct.pack(">I", len(request)) + request))
    data = b""
    try:
        while True:
            head = await reader.readexactly(9)
            length = int.from_bytes(head[:3], "big")
            kind, flags, stream_id = head[3], head[4], int.from_bytes(head[5:], "big") & 0x7FFFFFFF
            payload = await reader.readexactly(length)
            if kind == _SETTINGS and not flags & _ACK:
                writer.write(_frame(_SETTINGS, _ACK, 0, b""))
            elif stream_id == 1 and kind == _DATA:
                data += payload
            if stream_id == 1 and kind in (_DATA, _HEADERS) and flags & _END_STREAM:
                break
    finally:
        writer.close()
    return data[5:] if data else None
