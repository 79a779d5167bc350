"""The pair rule (services/frontend/pairing.py): KV layouts equal in every field, and each
side's tokenizer.json the tokenizer service's file where both are known."""

from __future__ import annotations

from mili.pb.kv.v1 import kv_pb2
from services.frontend.pairing import Side, pair_error

LAYOUT = kv_pb2.KvLayout(
    block_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32",
    block_order="block,slot,head,dim", model_fingerprint="abc",
)  # fmt: skip
SERVICE_FILE = "a" * 64
OTHER_FILE = "b" * 64


def check(prefill_file: str, decode_file: str, service_file: str = SERVICE_FILE) -> str | None:
    return pair_error(
        Side("prefill at p:1", LAYOUT, prefill_file),
        Side("decode at d:1", LAYOUT, decode_file),
        tokenizer_file_sha256=service_file,
        tokenizer_name="tokenizer service at t:1",
    )


def test_same_layout_and_the_services_tokenizer_pair() -> None:
    assert check(SERVICE_FILE, SERVICE_FILE) is None


def test_a_side_with_another_tokenizer_file_is_refused_naming_it_and_the_service() -> None:
    for prefill_file, decode_file, named in [
        (OTHER_FILE, SERVICE_FILE, "prefill at p:1"),
        (SERVICE_FILE, OTHER_FILE, "decode at d:1"),
    ]:
        error = check(prefill_file, decode_file)
        assert error is not None
        assert error.startswith(f"{named} runs a model whose tokenizer.json (sha256 bbbbbbbb")
        assert "tokenizer service at t:1 (sha256 aaaaaaaa" in error


def test_unknown_files_do_not_refuse() -> None:
    assert check("", "") is None  # instances without a tokenizer.json
    assert check(OTHER_FILE, OTHER_FILE, service_file="") is None  # tokenizer not polled yet


def test_a_layout_mismatch_is_refused_first_naming_both_layouts() -> None:
    other = kv_pb2.KvLayout()
    other.CopyFrom(LAYOUT)
    other.block_size = 32
    error = pair_error(
        Side("prefill at p:1", LAYOUT, OTHER_FILE),
        Side("decode at d:1", other, SERVICE_FILE),
        tokenizer_file_sha256=SERVICE_FILE,
        tokenizer_name="tokenizer service at t:1",
    )
    assert error is not None and error.startswith("KV layouts differ")
    assert "block_size=16" in error and "block_size=32" in error
