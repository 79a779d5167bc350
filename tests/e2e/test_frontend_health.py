"""The frontend's grpc.health.v1 status tells a load balancer the truth: NOT_SERVING while it
has no decode instance (or no tokenizer) to use, SERVING again once one is back on its address."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from tests.e2e.conftest import DECODE_ARGS, Deployment, deploy
from tests.service_process import ServiceProcess


def health(deployment: Deployment) -> str:
    stub = health_pb2_grpc.HealthStub(deployment.channel())
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as err:
        return str(err.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def wait_health(deployment: Deployment, expected: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (status := health(deployment)) != expected:
        if time.monotonic() > deadline:
            pytest.fail(
                f"frontend health {status}, expected {expected}; its log:\n"
                + deployment.frontend.stderr[-3000:]
            )
        time.sleep(0.1)


def port_of(service: ServiceProcess) -> str:
    return service.address.rpartition(":")[2]


def generate_ok(deployment: Deployment) -> None:
    request = generation_pb2.GenerateRequest(
        prompt="Hello", sampling=sampling_pb2.SamplingParams(max_tokens=4, temperature=0)
    )
    replies = list(deployment.stub().Generate(request, timeout=60))
    assert replies[-1].usage.completion_tokens >= 1


def test_health_follows_decode_and_tokenizer_going_and_coming_back(demo_model_dir: Path) -> None:
    model = ("--model", str(demo_model_dir))
    tokenizer = ServiceProcess("serve-tokenizer", *model, "--port", "0")
    try:
        deployment = deploy(demo_model_dir, tokenizer)
    except Exception:
        tokenizer.proc.kill()
        raise
    deployment.owns_tokenizer = True
    try:
        wait_health(deployment, "SERVING")

        decode = deployment.decodes[0]
        decode.proc.send_signal(signal.SIGKILL)
        decode.proc.wait()
        wait_health(deployment, "NOT_SERVING")
        assert "health NOT_SERVING: no decode instance is up" in deployment.frontend.stderr
        # Restarted where the frontend expects it (as `mili serve` does), it is found again.
        deployment.decodes[0] = ServiceProcess(
            "serve-decode", *model, "--port", port_of(decode), *DECODE_ARGS
        )
        wait_health(deployment, "SERVING")
        generate_ok(deployment)

        tokenizer.proc.send_signal(signal.SIGKILL)
        tokenizer.proc.wait()
        wait_health(deployment, "NOT_SERVING")
        assert f"health NOT_SERVING: the tokenizer at {tokenizer.address} is down" in (
            deployment.frontend.stderr
        )
        deployment.tokenizer = ServiceProcess(
            "serve-tokenizer", *model, "--port", port_of(tokenizer)
        )
        wait_health(deployment, "SERVING")
        generate_ok(deployment)
    finally:
        deployment.stop()
