"""What grpcurl and a load balancer see: reflection without stubs, health, graceful drain."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenizers import Tokenizer

from tests.reflection_client import ReflectionClient
from tests.service_process import ServiceProcess

SERVICE = "mili.tokenizer.v1.TokenizerService"


def test_reflection_only_client_lists_describes_and_calls(
    tokenizer_service: ServiceProcess, demo_model_dir: Path
) -> None:
    with grpc.insecure_channel(tokenizer_service.address) as channel:
        client = ReflectionClient(channel)
        services = client.services()
        assert SERVICE in services
        assert "grpc.health.v1.Health" in services

        method = client.method(f"{SERVICE}/Tokenize")
        assert method.input_type.full_name == "mili.tokenizer.v1.TokenizeRequest"
        assert method.output_type.full_name == "mili.tokenizer.v1.TokenizeResponse"
        fields = {f.name for f in method.input_type.fields}
        assert {"text", "messages", "add_generation_prompt", "enable_thinking"} <= fields
        stream = client.method(f"{SERVICE}/DetokenizeStream")
        assert stream.client_streaming and stream.server_streaming

        reply = client.call_json(f"{SERVICE}/Tokenize", '{"text": "Hello, 世界 🙂"}')
        expected = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json")).encode(
            "Hello, 世界 🙂"
        )
        assert reply["tokenIds"] == expected.ids
        assert reply["prompt"] == "Hello, 世界 🙂"


def _health(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_drain_reports_not_serving_and_finishes_in_flight_call(demo_model_dir: Path) -> None:
    service = ServiceProcess("serve-tokenizer", "--model", str(demo_model_dir), "--port", "0")
    try:
        with grpc.insecure_channel(service.address) as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
            assert _health(channel, SERVICE) == health_pb2.HealthCheckResponse.SERVING

            from mili.pb.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            outbox: queue.Queue = queue.Queue()
            ids = stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="in flight")).token_ids
            responses = stub.DetokenizeStream(iter(outbox.get, None))
            outbox.put(tokenizer_pb2.DetokenizeStreamRequest(token_ids=ids[:1]))
            first = next(responses).text  # the call is now in flight on the server

            service.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while _health(channel) != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, "health never went NOT_SERVING"
                time.sleep(0.05)
            assert _health(channel, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING

            # New work is turned away while draining...
            try:
                stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="late"), timeout=5)
                raise AssertionError("a new call was accepted during drain")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                assert "draining" in err.details()

            # ...but the in-flight stream completes normally.
            outbox.put(tokenizer_pb2.DetokenizeStreamRequest(token_ids=ids[1:], final=True))
            outbox.put(None)
            rest = "".join(r.text for r in responses)
            assert first + rest == "in flight"
        exit_code = service.proc.wait(timeout=30)
        assert exit_code == 0, service.stderr
        assert "drain" in service.stderr
    finally:
        if service.proc.poll() is None:
            service.proc.kill()


def test_service_serves_with_its_stdout_gone(demo_model_dir: Path) -> None:
    """A service whose stdout reader exited (`mili serve-tokenizer | grep -m1 listening`): the
    address lines it prints once serving raised BrokenPipeError and it exited 1 at its start.
    It serves, and drains on SIGTERM, with no one reading them."""
    out_read, out_write = os.pipe()
    os.close(out_read)  # every write to stdout fails: EPIPE
    command = ["serve-tokenizer", "--model", str(demo_model_dir), "--port", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mili", *command, "--metrics-port", "0"],
        stdout=out_write,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    os.close(out_write)
    try:
        assert proc.stderr is not None
        logged = []
        for line in proc.stderr:  # the log line of its start, written before the address lines
            logged.append(line.decode())
            if " serving mili.tokenizer.v1" in logged[-1]:
                break
        else:
            raise AssertionError("".join(logged[-20:]))
        time.sleep(1.0)
        assert proc.poll() is None, (proc.returncode, proc.stderr.read().decode()[-3000:])
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert code in (0, 120), code  # 120: Python could not flush its output at exit
