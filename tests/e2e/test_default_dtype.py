"""Without --dtype, prefill and decode run in the device's fastest type (float32 on CPU, even
for the demo model's bfloat16 checkpoint) and log why; an explicit --dtype wins."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from mili.flags import default_dtype
from mili.pb.decode.v1 import decode_pb2, decode_pb2_grpc
from mili.pb.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from tests.e2e.conftest import DECODE_ARGS, PREFILL_ARGS, start_all


def test_each_device_has_its_fastest_default() -> None:
    assert default_dtype("cpu")[0] == "float32"
    assert default_dtype("cuda")[0] == default_dtype("cuda:1")[0] == "bfloat16"


@pytest.mark.parametrize(
    ("flags", "dtype", "why"),
    [
        ((), "float32", "dtype float32 on cpu: the device's default (no --dtype): CPU matmuls"),
        (("--dtype", "bfloat16"), "bfloat16", "dtype bfloat16 on cpu: as --dtype asks"),
    ],
)
def test_prefill_and_decode_pick_and_log_their_dtype(
    demo_model_dir: Path, flags: tuple[str, ...], dtype: str, why: str
) -> None:
    model = ("--model", str(demo_model_dir), "--port", "0", *flags)
    prefill, decode = start_all(
        [
            ("serve-prefill", *model, *PREFILL_ARGS, "--decode", "*"),
            ("serve-decode", *model, *DECODE_ARGS),
        ]
    )
    try:
        with grpc.insecure_channel(prefill.address) as channel:
            stub = prefill_pb2_grpc.PrefillServiceStub(channel)
            assert stub.Info(prefill_pb2.InfoRequest(), timeout=10).dtype == dtype
        with grpc.insecure_channel(decode.address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            assert stub.Info(decode_pb2.InfoRequest(), timeout=10).dtype == dtype
    finally:
        codes = [service.terminate() for service in (prefill, decode)]
    assert codes == [0, 0]
    for service in (prefill, decode):
        assert sum(why in line for line in service.stderr_lines) == 1, service.stderr
