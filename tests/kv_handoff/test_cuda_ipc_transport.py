"""CudaIpcTransport's copies and checks on CPU tensors: one pool's bytes seen by both ends (as
prefill's mapping and decode's own are on a GPU), no stream and no export here. What it writes
into decode's blocks, what the chunk messages announce, and what `land_all` refuses. The GPU
run (tests/prefill/test_cuda_ipc.py, -m gpu) takes it between two processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mili.engine.kv.kv_layout import KVLayout
from mili.engine.model.kv_cache import pool_blocks, pool_bytes
from mili.errors import DataLoss
from mili.kv_handoff import codec, cuda_ipc
from mili.kv_handoff.cuda_ipc_transport import CudaIpcTransport
from mili.kv_handoff.kv_part import KvPart
from services.prefill.pairing import Pairing, Peers

LAYOUT = KVLayout(num_layers=5, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
NUM_BLOCKS = 16
DTYPE = torch.bfloat16


def _pool() -> torch.Tensor:
    storage = torch.zeros(pool_bytes(LAYOUT, NUM_BLOCKS, DTYPE), dtype=torch.uint8)
    return pool_blocks(storage, LAYOUT, NUM_BLOCKS, DTYPE)


def _kv(num_layers: int, n: int, seed: int) -> torch.Tensor:
    shape = (num_layers, 2, n, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    # Random bit patterns (NaN payloads included): the copy must not touch a bit.
    bits = torch.randint(-(2**15), 2**15, shape, generator=torch.Generator().manual_seed(seed))
    return bits.to(torch.int16).view(DTYPE)


def _chunks(messages: list[bytes]) -> list[codec.ChunkView]:
    chunks = [codec.parse_transfer_request(m) for m in messages]
    assert all(isinstance(c, codec.ChunkView) for c in chunks)
    return chunks  # type: ignore[return-value]


def test_parts_of_several_layers_land_in_decodes_blocks_one_chunk_per_layer() -> None:
    pool = _pool()
    sender, receiver = CudaIpcTransport(pool), CudaIpcTransport(pool)
    parts = [KvPart(0, [9, 2, 14], _kv(5, 3, 1)), KvPart(1, [5], _kv(2, 1, 2))]
    messages, num_bytes = sender.encode_all("r", 7, parts)
    assert num_bytes == sum(p.kv.nbytes for p in parts)
    chunks = _chunks(messages)
    assert [(c.seq, c.layer, list(c.block_ids)) for c in chunks] == [
        *((7 + i, i, [9, 2, 14]) for i in range(5)),
        (12, 1, [5]),
        (13, 2, [5]),
    ]
    for part in parts:
        for i, layer_kv in enumerate(part.kv):
            for side in (0, 1):
                written = pool[part.layer + i, side][list(part.block_ids)]
                assert torch.equal(written.view(torch.int16), layer_kv[side].view(torch.int16))
    receiver.land_all(chunks, "crc32")  # runs of layers and single chunks alike
    receiver.land_all(chunks[5:] + chunks[:2], "crc32")
    assert len({c.crc32 for c in chunks}) == len(chunks)


def test_land_all_refuses_a_block_changed_since_and_names_the_chunk() -> None:
    pool = _pool()
    transport = CudaIpcTransport(pool)
    chunks = _chunks(transport.encode_all("r", 0, [KvPart(0, [3, 4], _kv(5, 2, 3))])[0])
    transport.land_all(chunks, "crc32")
    pool[3, 1, 4].view(torch.int16)[0, 0, 0] ^= 1  # one bit of layer 3's V, block 4
    with pytest.raises(DataLoss, match=r"layer 3.*checksum mismatch"):
        transport.land_all(chunks, "crc32")
    transport.land_all(chunks[:3] + chunks[4:], "crc32")  # the other layers still hold


@pytest.mark.parametrize(
    "part",
    [
        KvPart(0, [16], _kv(1, 1, 0)),  # a block outside the pool
        KvPart(4, [1], _kv(2, 1, 0)),  # layers past the model's
        KvPart(0, [1, 2], _kv(1, 1, 0)),  # fewer blocks than ids
        KvPart(0, [1], _kv(1, 1, 0).float()),  # another dtype
    ],
)
def test_encode_all_refuses_what_does_not_fit_and_writes_nothing(part: KvPart) -> None:
    pool = _pool()
    with pytest.raises(ValueError):
        CudaIpcTransport(pool).encode_all("r", 0, [part])
    assert not pool.view(torch.int16).any()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid names no process now
    return child.pid


def test_a_pair_whose_decode_died_is_not_alive() -> None:
    """Prefill's mapping of a decode's pool knows the exporter's pid (same pid namespace), so
    the sweep forgets a decode killed between transfers before a transfer writes into its freed
    pool (a decode restarted on the same address exports a new one)."""
    assert not CudaIpcTransport(_pool(), owner_pid=_dead_pid()).is_peer_alive()
    assert CudaIpcTransport(_pool(), owner_pid=os.getpid()).is_peer_alive()
    assert CudaIpcTransport(_pool()).is_peer_alive()  # owner unknown: a failed transfer tells


def test_the_export_names_its_owner_in_this_pid_namespace_only() -> None:
    namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    blob = json.dumps({"pid": 4321, "pid_ns": namespace}).encode()
    assert cuda_ipc.owner(blob) == 4321
    assert cuda_ipc.owner(json.dumps({"pid": 4321, "pid_ns": "1"}).encode()) is None
    assert cuda_ipc.owner(json.dumps({"handle": "00"}).encode()) is None
    assert cuda_ipc.owner(b"not json") is None


def test_the_sweep_forgets_a_pair_whose_decode_died() -> None:
    peers = Peers(1 << 20)
    peers._pairings["dead:1"] = Pairing(CudaIpcTransport(_pool(), owner_pid=_dead_pid()))
    peers._pairings["alive:1"] = Pairing(CudaIpcTransport(_pool(), owner_pid=os.getpid()))
    peers.sweep()
    assert peers.transports() == {"alive:1": "cuda-ipc"}
