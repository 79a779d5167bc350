"""MILI's public gRPC API from Node, as a backend team calls it: @grpc/grpc-js with the protos
loaded at run time (tests/e2e/node/generation_client.js) against a real deployment."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from google.rpc import status_pb2

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from tests.e2e.conftest import Deployment
from tests.service_process import ROOT

SCRIPT = ROOT / "tests" / "e2e" / "node" / "generation_client.js"
NODE = shutil.which("node")
# googleapis-common-protos ships google/rpc/*.proto beside its stubs: the Node client's copy.
GOOGLEAPIS = Path(status_pb2.__file__).parent.parent.parent

pytestmark = [
    pytest.mark.skipif(NODE is None, reason="node is not on PATH (make setup needs Node.js)"),
    pytest.mark.skipif(
        not (ROOT / "node_modules" / "@grpc" / "grpc-js").is_dir(),
        reason="node_modules/@grpc/grpc-js is missing: run make setup",
    ),
]


def test_node_streams_the_python_clients_tokens_and_decodes_bad_request(
    pipeline: Deployment,
) -> None:
    assert NODE is not None
    node = subprocess.run(
        [NODE, str(SCRIPT), pipeline.frontend.address, str(GOOGLEAPIS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert node.returncode == 0, node.stderr
    result = json.loads(node.stdout)
    # The script's greedy request: temperature 0 must arrive as set (a proto3 optional field),
    # not as unset, which would sample at the model's default temperature.
    sampling = sampling_pb2.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    request = generation_pb2.GenerateRequest(prompt="Hello", sampling=sampling)
    replies = list(pipeline.stub().Generate(request, timeout=60))
    generated = result["generated"]
    assert generated["token_ids"] == [i for r in replies for i in r.token_ids]
    assert len(generated["token_ids"]) == 12
    assert generated["text"] == "".join(r.text for r in replies)
    assert generated["finish_reason"] == "FINISH_REASON_LENGTH"
    usage = generated["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        replies[-1].usage.prompt_tokens,
        12,
    )
    assert result["error"] == {"code": "INVALID_ARGUMENT", "fields": ["sampling.top_p"]}
