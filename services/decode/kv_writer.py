"""KVWriter: prompt blocks landed from prefill written into decode's KV cache, off the step.

The grpc transport (mili.kv_handoff.transport) calls `scatter` from decode's landing threads
while the batch thread runs steps: safe because the blocks belong to a request that is not in
the batch yet, and no step reads or writes them.
"""

from __future__ import annotations

import torch

from mili.engine.model.kv_cache import KVCache
from mili.engine.step.pinned import StagingRing, pinned_empty, thread_stream
from mili.kv_handoff import block_rows

# Pinned host memory for grpc chunks landing on a GPU: each landing thread stages one chunk (a
# layer of at most a prefill step's tokens) at a time, and a transfer holds at most 16 MiB of
# chunks (transfer.py's _MAX_LANDING_BYTES); larger ones use torch's caching host allocator.
_STAGING_BYTES = 64 << 20


class KVWriter:
    """Writes whole prompt blocks into `cache` (mili.kv_handoff.transport.Scatter); any
    thread."""

    def __init__(self, cache: KVCache) -> None:
        self._cache = cache
        device = cache.device
        # decode's landing threads stage grpc chunks here on their way to the GPU
        self._staging = StagingRing(_STAGING_BYTES, device) if device.type == "cuda" else None

    def scatter(self, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write whole prompt blocks of one layer into the cache (k, v: [n, S, KVH, D]).

        Called from a landing thread while the batch thread runs (module docstring).
        """
        cache = self._cache
        pairs = ((cache.k[layer], k), (cache.v[layer], v))
        if all(block_rows.fits(dst, block_ids, src) for dst, src in pairs):
            for dst, src in pairs:
                block_rows.write_blocks(dst, block_ids, src)
            return
        if cache.device.type == "cuda" and k.device.type == "cpu":
            self._scatter_from_host(layer, block_ids, k, v)
            return
        with torch.inference_mode():
            cache.scatter_blocks(layer, block_ids, k, v)  # input it will refuse

    def _scatter_from_host(
        self, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """CUDA: stage k, v (pageable, [n, S, KVH, D]) in pinned memory (the staging ring's, or
        torch's caching host allocator's where the ring is full) and copy them in on a landing
        stream of this thread's own, then wait for that stream here. The model's stream never
        waits for a landing, and the request joins the batch only after every landing returned
        (the commit waits for them), so its first step reads landed blocks."""
        cache = self._cache
        stream = thread_stream(cache.device)
        with torch.inference_mode(), torch.cuda.stream(stream):
            k_pinned = pinned_empty(k.shape, k.dtype, self._staging).copy_(k)
            v_pinned = pinned_empty(v.shape, v.dtype, self._staging).copy_(v)
            try:
                cache.scatter_blocks(layer, block_ids, k_pinned, v_pinned)
            finally:
                # this landing thread waits; only then may the staging spans be reused
                stream.synchronize()
