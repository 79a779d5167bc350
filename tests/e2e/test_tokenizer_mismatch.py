"""Prefill and decode started on a model directory whose tokenizer.json is not the tokenizer
service's: the frontend refuses the pair loudly, reports NOT_SERVING, and a request fails with
FAILED_PRECONDITION naming the file, instead of token ids meaning other text to the model."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import grpc
import pytest

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from tests.e2e.conftest import deploy
from tests.service_process import ServiceProcess


def test_a_model_with_another_tokenizer_file_is_never_routed(
    demo_model_dir: Path, e2e_tokenizer: ServiceProcess, tmp_path: Path
) -> None:
    other = tmp_path / "other-tokenizer"
    shutil.copytree(demo_model_dir, other)
    tokenizer_json = other / "tokenizer.json"
    # The same tokens in other bytes: a different file, as another model's would be.
    tokenizer_json.write_text(json.dumps(json.loads(tokenizer_json.read_text()), indent=1))
    deployment = deploy(other, e2e_tokenizer)
    try:
        log = deployment.frontend
        deadline = time.monotonic() + 30
        while "REFUSING PAIR" not in log.stderr and time.monotonic() < deadline:
            time.sleep(0.1)
        refusal = next(line for line in log.stderr.splitlines() if "REFUSING PAIR" in line)
        assert "tokenizer.json" in refusal and e2e_tokenizer.address in refusal
        request = generation_pb2.GenerateRequest(
            token_ids=[100, 101, 102],
            sampling=sampling_pb2.SamplingParams(max_tokens=2, temperature=0.0),
        )
        with pytest.raises(grpc.RpcError) as info:
            list(deployment.stub().Generate(request, timeout=30))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
        assert "tokenizer.json" in info.value.details()
    finally:
        deployment.stop()
