"""What prefill hands a KV transport to move: one prompt chunk's blocks in a run of layers
(mili.kv_handoff.transport's `encode_all`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class KvPart(NamedTuple):
    """The KV of one prompt chunk's blocks in layers layer, layer + 1, ... as prefill hands it
    to `encode_all`: one chunk (and one chunk message) per layer."""

    layer: int  # the first
    block_ids: Sequence[int]  # decode's blocks, in the order of kv's third dimension
    kv: torch.Tensor  # [num_layers, 2 (K, V), len(block_ids), block_size, num_kv_heads, D]

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]
