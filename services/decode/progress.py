"""What one KV transfer has written so far (pure bookkeeping, below the gRPC servicer in
services/decode/transfer.py): the header is checked against the request and this instance,
every chunk against the request's reservation and what came before it, and the commit against
the header's promise.

    start         num_tokens = the prompt's, a transport this instance paired with, a checksum
                  it has                                        -> InvalidArgument otherwise
    check_chunk   seq in order, request id, layer in range, blocks among the prompt's blocks
                  to receive and none sent twice for that layer      -> DataLoss otherwise
    record        the chunk goes to landing: its (layer, blocks) count as written
    check_complete   chunk count = the header's, every (layer, prompt block) written once
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import NamedTuple, Protocol

from mili.errors import DataLoss, InvalidArgument
from mili.kv_handoff import checksums, kv_transport
from mili.plural import plural
from services.decode.requests import DecodeRequest


class Header(NamedTuple):
    """What the bookkeeping reads of a transfer's header (converted at the edge, which checked
    its layout: services/decode/convert.py)."""

    num_tokens: int  # the prompt's length
    num_chunks: int  # chunks to come: one per layer per shipped prompt chunk
    transport: str  # a name of mili.kv_handoff.kv_transport; "" (the wire's default) is grpc
    checksum: str  # a name of mili.kv_handoff.checksums; "" is CRC-32


class Chunk(Protocol):
    """What the bookkeeping reads of a chunk (a KvChunk or a codec.ChunkView)."""

    @property
    def request_id(self) -> str: ...

    @property
    def seq(self) -> int: ...

    @property
    def layer(self) -> int: ...

    @property
    def block_ids(self) -> Sequence[int]: ...


class TransferProgress:
    """What one transfer has written so far; raises DataLoss on anything out of place."""

    def __init__(
        self,
        request: DecodeRequest,
        num_layers: int,
        num_chunks: int,
        transport: str,
        checksum: str,
    ) -> None:
        """`transport`, `checksum`: the header's (names in mili.kv_handoff.kv_transport and
        checksums), checked by `start`."""
        self.request = request
        self.num_chunks_expected = num_chunks
        self.num_chunks = 0
        self.num_bytes = 0
        # "grpc": the bytes come in the chunks; else the sender wrote the blocks itself
        # (shm, cuda-ipc): verify them in place, copy nothing (the servicer's to act on)
        self.transport = transport
        self.checksum = checksum
        self._prompt_blocks = frozenset(request.received_block_ids)  # cached blocks: not sent
        self._num_layers = num_layers
        # blocks written so far, per layer (set operations, not a Python loop per block: a
        # transfer announces layers x blocks of them, 28 x 32 for a 512-token 0.6B prompt)
        self._written: list[set[int]] = [set() for _ in range(num_layers)]

    @classmethod
    def start(
        cls, request: DecodeRequest, header: Header, num_layers: int, transports: Container[str]
    ) -> TransferProgress:
        """The bookkeeping of a transfer whose header `request` and this instance can take
        (`transports`: those it paired with); InvalidArgument naming the header's field else."""
        if header.num_tokens != request.num_prompt_tokens:
            raise InvalidArgument(
                "header.num_tokens",
                header.num_tokens,
                f"request {request.name} has {request.num_prompt_tokens} prompt tokens",
            )
        transport = header.transport or kv_transport.GRPC
        if transport not in transports:
            raise InvalidArgument(
                "header.transport", transport, "this decode instance did not pair with it"
            )
        checksum = header.checksum or checksums.CRC32
        if checksum not in checksums.available():
            raise InvalidArgument("header.checksum", checksum, "this decode instance lacks it")
        return cls(request, num_layers, header.num_chunks, transport, checksum)

    def check_chunk(self, chunk: Chunk) -> None:
        where = f"request {self.request.name} chunk {chunk.seq}"
        if chunk.seq != self.num_chunks:
            raise DataLoss(
                f"{where}: expected chunk {self.num_chunks} (chunk lost, duplicated or reordered)"
            )
        if chunk.seq >= self.num_chunks_expected:
            announced = plural(self.num_chunks_expected, "chunk")
            raise DataLoss(f"{where}: the header announced {announced}")
        if chunk.request_id != self.request.request_id:
            raise DataLoss(f"{where}: carries request id {chunk.request_id!r}")
        if chunk.layer >= self._num_layers:
            raise DataLoss(f"{where}: layer out of range (model has {self._num_layers})")
        ids = chunk.block_ids
        blocks = set(ids)
        if not blocks <= self._prompt_blocks:
            foreign = [b for b in ids if b not in self._prompt_blocks]
            raise DataLoss(
                f"{where}: block ids {foreign[:8]} are not among the request's prompt blocks "
                f"to receive {self.request.received_block_ids}"
            )
        written = self._written[chunk.layer]
        if len(blocks) != len(ids) or not written.isdisjoint(blocks):
            seen: set[int] = set()
            for block in ids:  # the first one sent twice, for the message
                if block in seen or block in written:
                    raise DataLoss(
                        f"{where}: layer {chunk.layer} block {block} sent more than once"
                    )
                seen.add(block)

    def record(self, chunk: Chunk, num_bytes: int) -> None:
        """`chunk` passed `check_chunk` and goes to landing: a later duplicate is refused."""
        self._written[chunk.layer].update(chunk.block_ids)
        self.num_chunks += 1
        self.num_bytes += num_bytes

    def check_complete(self) -> None:
        where = f"request {self.request.name}"
        if self.num_chunks != self.num_chunks_expected:
            raise DataLoss(
                f"{where}: commit after {plural(self.num_chunks, 'chunk')}, the header announced "
                f"{self.num_chunks_expected}"
            )
        missing = [
            (layer, sorted(self._prompt_blocks - written))
            for layer, written in enumerate(self._written)
            if len(written) != len(self._prompt_blocks)
        ]
        if missing:
            layer, blocks = missing[0]
            num_missing = sum(len(b) for _, b in missing)
            raise DataLoss(
                f"{where}: {num_missing} (layer, block) pairs never sent, e.g. layer {layer} "
                f"block {blocks[0]}"
            )
