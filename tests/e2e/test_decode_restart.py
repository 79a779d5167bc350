"""A decode instance that died and came back on its address is reached again by prefill at
once: the first requests after it is back succeed, even though prefill's channel to it was
backing off from the transfers that failed while it was down (grpc fails a call at once on a
channel in backoff; prefill now waits a moment for it to connect)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from mili.pb.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from tests.e2e.conftest import DECODE_ARGS, deploy
from tests.service_process import ServiceProcess

pytestmark = pytest.mark.slow


def _complete(stub: object) -> generation_pb2.CompleteResponse:
    request = generation_pb2.CompleteRequest(
        token_ids=list(range(100, 120)),
        sampling=sampling_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    return stub.Complete(request, timeout=30)  # type: ignore[attr-defined]


def test_requests_right_after_a_decode_restart_succeed(
    demo_model_dir: Path, e2e_tokenizer: ServiceProcess
) -> None:
    d = deploy(demo_model_dir, e2e_tokenizer)
    try:
        stub = d.stub()
        assert _complete(stub).usage.completion_tokens == 4  # prefill's channel is connected
        address = d.decodes[0].address
        d.decodes[0].proc.kill()
        d.decodes[0].proc.wait()
        # Transfers to the dead decode (as for requests admitted just before it died) fail,
        # and leave prefill's channel to it backing off between reconnection attempts.
        with grpc.insecure_channel(d.prefills[0].address) as channel:
            prefill = prefill_pb2_grpc.PrefillServiceStub(channel)
            for i in range(3):
                doomed = prefill_pb2.PrefillRequest(
                    request_id=f"doomed-{i}",
                    prompt_token_ids=list(range(100, 120)),
                    sampling=sampling_pb2.SamplingParams(max_tokens=4),
                    destination=prefill_pb2.KvDestination(
                        address=address, prompt_block_ids=[0, 1], transfer_token="x"
                    ),
                )
                with pytest.raises(grpc.RpcError) as failed:
                    prefill.Prefill(doomed, timeout=30)
                assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
                time.sleep(0.7)
        port = address.rpartition(":")[2]
        d.decodes[0] = ServiceProcess(
            "serve-decode", "--model", str(demo_model_dir), "--port", port, *DECODE_ARGS
        )
        d.wait_until_routable()
        deadline = time.monotonic() + 20
        while True:  # the frontend's next Info poll finds it up
            try:
                first = _complete(stub)
                break
            except grpc.RpcError as err:
                # Only the frontend's own view may lag: never prefill failing to reach decode.
                assert "prefill" not in (err.details() or ""), err.details()
                assert time.monotonic() < deadline, err.details()
                time.sleep(0.05)
        assert first.usage.completion_tokens == 4
        for _ in range(5):
            assert _complete(stub).usage.completion_tokens == 4
    finally:
        d.stop()
