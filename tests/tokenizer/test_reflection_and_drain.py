"""What grpcurl and a load balancer see: reflection without stubs, health, graceful drain."""

from __future__ import annotations

import queue
import signal
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
