"""A prefix cache's reading as the PrefixCacheInfo both prefill's and decode's Info carry."""

from __future__ import annotations

from mili.engine.kv.prefix_cache import PrefixCacheReading
from mili.pb.kv.v1 import kv_pb2


def prefix_cache_to_proto(reading: PrefixCacheReading) -> kv_pb2.PrefixCacheInfo:
    return kv_pb2.PrefixCacheInfo(
        enabled=reading.enabled,
        num_cached_blocks=reading.cached_blocks,
        query_tokens=reading.query_tokens,
        hit_tokens=reading.hit_tokens,
        evicted_blocks=reading.evicted_blocks,
    )
