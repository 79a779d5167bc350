"""Chained keys of full KV blocks: the key of block i names the whole prefix up to its end.

Torch-free and stateless, so every process computes the same keys from token ids alone: prefill
and decode index their cached blocks by them, and the frontend routes a prompt to the instance
that already holds its longest prefix.

    key(0) = blake2b(ROOT || ids[0:B]),  key(i) = blake2b(key(i-1) || ids[i*B:(i+1)*B])

Token ids are packed as little-endian uint32 (Qwen3's vocabulary fits); a 16-byte digest makes
an accidental collision (which would hand a request someone else's KV) negligible.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

KEY_BYTES = 16
_ROOT = b"mili-prefix-v1"


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Keys of every *full* block of `token_ids`; a partial last block has none."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    num_full = len(token_ids) // block_size
    keys: list[bytes] = []
    parent = _ROOT
    pack = struct.Struct(f"<{block_size}I").pack
    for i in range(num_full):
        chunk = token_ids[i * block_size : (i + 1) * block_size]
        parent = hashlib.blake2b(parent + pack(*chunk), digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys
