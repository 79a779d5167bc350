"""Whether a prefill and a decode instance may serve requests together: the one rule behind the
frontend's pair checks (Backends runs it after every Info poll, and for every pair again when
the tokenizer service's file changes).

    KV layouts  equal in every field (mili.rpc.kv_layout.check_compatible: block size, layers,
                heads, dtype, and the model fingerprint, which covers the weights and the
                tokenizer.json): else KV blocks cannot move between the two
    tokenizer   each side's tokenizer.json is the tokenizer service's file, where both are
                known: else a prompt's token ids (the service's) would mean other text to the
                model, and so would the ids it answers with

A refused pair is never routed; the error names both sides and is what a request gets
(FAILED_PRECONDITION) once no compatible pair is left. Torch-free and pure.
"""

from __future__ import annotations

from typing import NamedTuple

from mili.errors import FailedPrecondition
from mili.pb.kv.v1 import kv_pb2
from mili.rpc.kv_layout import check_compatible


class Side(NamedTuple):
    """One instance of a pair, as its last Info described it."""

    name: str  # "prefill at ADDRESS" / "decode at ADDRESS"
    layout: kv_pb2.KvLayout
    tokenizer_file_sha256: str  # "" when it reported none


def pair_error(
    prefill: Side, decode: Side, *, tokenizer_file_sha256: str, tokenizer_name: str
) -> str | None:
    """Why `prefill` and `decode` cannot serve together, or None. `tokenizer_file_sha256`: the
    tokenizer service's file ("" while unknown), `tokenizer_name` what to call the service."""
    try:
        check_compatible(
            prefill.layout, decode.layout, local_name=prefill.name, remote_name=decode.name
        )
    except FailedPrecondition as exc:
        return str(exc)
    for side in (prefill, decode):
        if tokenizer_file_sha256 and side.tokenizer_file_sha256 not in ("", tokenizer_file_sha256):
            return (
                f"{side.name} runs a model whose tokenizer.json (sha256 "
                f"{side.tokenizer_file_sha256[:16]}) is not the file of the {tokenizer_name} "
                f"(sha256 {tokenizer_file_sha256[:16]}): token ids would mean other text; start "
                f"them from the same model directory"
            )
    return None
