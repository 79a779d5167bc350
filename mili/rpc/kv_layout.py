"""KV layouts on the wire: the KvLayout message, its description, and the compatibility check.

Both sides publish a KvLayout; `check_compatible` refuses a pair that differs in any field,
naming both layouts, so a mismatch is a FAILED_PRECONDITION at set-up, never garbage tokens.

Torch-free on purpose: the frontend checks every prefill/decode pair with it and must not load
torch to do so. The chunks themselves (tensors <-> bytes) are `mili.kv_handoff.codec`'s.
"""

from __future__ import annotations

from mili.engine.kv.kv_layout import KVLayout
from mili.engine.kv.kv_layout import block_bytes as _block_bytes
from mili.errors import FailedPrecondition
from mili.pb.kv.v1 import kv_pb2

BLOCK_ORDER = "block,slot,head,dim"  # [num_blocks, block_size, num_kv_heads, head_dim]


def layout_to_proto(layout: KVLayout, model_fingerprint: str) -> kv_pb2.KvLayout:
    return kv_pb2.KvLayout(
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        block_order=BLOCK_ORDER,
        model_fingerprint=model_fingerprint,
    )


def describe(layout: kv_pb2.KvLayout) -> str:
    return (
        f"block_size={layout.block_size} num_layers={layout.num_layers} "
        f"num_kv_heads={layout.num_kv_heads} head_dim={layout.head_dim} dtype={layout.dtype} "
        f"block_order={layout.block_order} model={layout.model_fingerprint}"
    )


def check_compatible(
    local: kv_pb2.KvLayout, remote: kv_pb2.KvLayout, *, local_name: str, remote_name: str
) -> None:
    """Raise FailedPrecondition naming both layouts unless they are equal in every field."""
    if local != remote:
        raise FailedPrecondition(
            f"KV layouts differ, so KV blocks cannot move between {local_name} and "
            f"{remote_name}: {local_name} has [{describe(local)}], {remote_name} has "
            f"[{describe(remote)}]"
        )


def block_bytes(layout: kv_pb2.KvLayout) -> int:
    """Bytes of one block of one layer, K or V alone; FailedPrecondition for a dtype we lack."""
    try:
        return _block_bytes(layout.block_size, layout.num_kv_heads, layout.head_dim, layout.dtype)
    except ValueError:
        raise FailedPrecondition(f"unsupported KV dtype {layout.dtype!r}") from None
