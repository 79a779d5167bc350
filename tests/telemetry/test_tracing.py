"""Tracing end to end: `mili serve --otlp-endpoint` exports one connected trace per Generate call
to a real OTLP/gRPC receiver, and with tracing off nothing is installed."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from opentelemetry.proto.trace.v1 import trace_pb2

from mili.engine.model.config import Qwen3Config
from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from mili.telemetry.tracing import TracingConfig, setup_tracing
from tests.otlp_receiver import Receiver, serving
from tests.service_process import ServiceProcess

BLOCK_SIZE = 4  # small: the 1-token demo prompt still spans a block boundary or two
SERVICES = ("mili-frontend", "mili-tokenizer", "mili-prefill", "mili-decode")


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    with serving() as served:
        yield served


def _attrs(span: trace_pb2.Span) -> dict[str, object]:
    out: dict[str, object] = {}
    for a in span.attributes:
        value = a.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[a.key] = [getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
        else:
            out[a.key] = getattr(value, kind) if kind else None
    return out


def _one(spans: list[tuple[str, trace_pb2.Span]], service: str, name: str) -> trace_pb2.Span:
    found = [s for svc, s in spans if svc == service and s.name == name]
    assert len(found) == 1, f"{service} {name!r}: {len(found)} spans; have " + ", ".join(
        sorted({f"{svc}:{s.name}" for svc, s in spans})
    )
    return found[0]


def test_one_generate_is_one_connected_trace(
    demo_model_dir: Path, receiver: tuple[Receiver, int]
) -> None:
    collector, port = receiver
    serve = ServiceProcess(
        "serve",
        "--model",
        str(demo_model_dir),
        "--port",
        "0",
        "--otlp-endpoint",
        f"http://127.0.0.1:{port}",
        "--dtype",  # the checkpoint's: the byte count below is computed from its torch_dtype
        "bfloat16",
        "--prefill-args",
        f"--num-blocks 256 --block-size {BLOCK_SIZE}",
        "--decode-args",
        f"--num-blocks 256 --block-size {BLOCK_SIZE}",
        timeout_s=180,
    )
    try:
        with grpc.insecure_channel(serve.address) as channel:
            responses = list(
                generation_pb2_grpc.GenerationServiceStub(channel).Generate(
                    generation_pb2.GenerateRequest(
                        prompt="Hello",
                        sampling=sampling_pb2.SamplingParams(
                            max_tokens=8, temperature=0, ignore_eos=True
                        ),
                    ),
                    timeout=60,
                )
            )
    finally:
        code = serve.terminate(timeout_s=90)  # SIGTERM: every child drains, then flushes
    assert code == 0, serve.stderr[-3000:]
    usage = responses[-1].usage
    assert usage.completion_tokens == 8
    num_prompt_tokens = usage.prompt_tokens
    assert num_prompt_tokens >= 1

    deadline = time.monotonic() + 15  # the exporters flushed on exit; allow a late batch
    while True:
        spans = collector.snapshot()
        if {svc for svc, _ in spans} >= set(SERVICES) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {svc for svc, _ in spans} >= set(SERVICES)

    by_id = {s.span_id: (svc, s) for svc, s in spans}
    request = _one(spans, "mili-frontend", f"generate {demo_model_dir.name}")
    trace_id = request.trace_id
    in_trace = [(svc, s) for svc, s in spans if s.trace_id == trace_id]

    def ancestors(span: trace_pb2.Span) -> list[tuple[str, str]]:
        chain = []
        while span.parent_span_id:
            svc, span = by_id[span.parent_span_id]
            chain.append((svc, span.name))
        return chain

    # Across services: each downstream SERVER span's parent is the frontend's CLIENT span.
    for service, method in [
        ("mili-tokenizer", "mili.tokenizer.v1.TokenizerService/Tokenize"),
        ("mili-prefill", "mili.prefill.v1.PrefillService/Prefill"),
        ("mili-decode", "mili.decode.v1.DecodeService/Generate"),
    ]:
        server = _one(in_trace, service, f"/{method}")
        assert server.kind == trace_pb2.Span.SPAN_KIND_SERVER
        parent_service, parent = by_id[server.parent_span_id]
        assert (parent_service, parent.name, parent.kind) == (
            "mili-frontend",
            method,
            trace_pb2.Span.SPAN_KIND_CLIENT,
        )
        assert ("mili-frontend", request.name) in ancestors(server)

    # No stray traces: every tokenizer and frontend span belongs to this request's trace (the
    # per-token DetokenizeStream is not traced, rather than starting a trace of its own).
    for service in ("mili-tokenizer", "mili-frontend"):
        assert {s.trace_id for svc, s in spans if svc == service} == {trace_id}, service

    # The KV stream carries the trace: decode's TransferKv is under prefill's `kv transfer`.
    transfer = _one(in_trace, "mili-prefill", "kv transfer")
    received = _one(in_trace, "mili-decode", "/mili.kv.v1.KvTransferService/TransferKv")
    chain = ancestors(received)
    assert chain[:2] == [
        ("mili-prefill", "mili.kv.v1.KvTransferService/TransferKv"),
        ("mili-prefill", "kv transfer"),
    ]
    assert ("mili-prefill", "/mili.prefill.v1.PrefillService/Prefill") in chain
    assert ("mili-frontend", request.name) in chain
    sent = _attrs(transfer)
    assert sent["mili.kv.bytes"] == _attrs(received)["mili.kv.bytes"]
    gb_per_s = sent["mili.kv.gb_per_s"]
    assert isinstance(gb_per_s, float) and gb_per_s > 0
    # Every prompt block of every layer, K and V: exactly the bytes the caches hold for it.
    model = Qwen3Config.from_file(demo_model_dir / "config.json")
    itemsize = torch.empty((), dtype=getattr(torch, model.torch_dtype)).element_size()
    block_bytes = BLOCK_SIZE * model.num_key_value_heads * model.head_dim * itemsize
    num_blocks = -(-num_prompt_tokens // BLOCK_SIZE)
    assert sent["mili.kv.num_blocks"] == num_blocks
    assert sent["mili.kv.num_layers"] == model.num_hidden_layers
    assert sent["mili.kv.bytes"] == 2 * model.num_hidden_layers * num_blocks * block_bytes

    compute = _one(in_trace, "mili-prefill", "prefill compute")
    assert _attrs(compute)["mili.prefill.num_prompt_tokens"] == num_prompt_tokens
    assert _attrs(compute)["mili.prefill.batch_size"] == 1
    assert _attrs(compute)["mili.prefill.num_cached_tokens"] == 0  # a prompt never seen before

    # Batched steps are roots in their own traces, linked to the requests they served.
    decode_request = _one(in_trace, "mili-decode", "decode request")
    assert _attrs(decode_request)["mili.decode.num_output_tokens"] == 8
    assert _attrs(decode_request)["mili.decode.num_cached_blocks"] == 0
    steps = [s for svc, s in spans if svc == "mili-decode" and s.name == "decode step"]
    linked = [s for s in steps if any(link.span_id == decode_request.span_id for link in s.links)]
    assert len(linked) == 7  # the first token is prefill's; 7 decode steps make the rest
    assert all(not s.parent_span_id and s.trace_id != trace_id for s in linked)
    prefill_server = _one(in_trace, "mili-prefill", "/mili.prefill.v1.PrefillService/Prefill")
    prefill_steps = [s for svc, s in spans if svc == "mili-prefill" and s.name == "prefill step"]
    assert any(link.span_id == prefill_server.span_id for s in prefill_steps for link in s.links)

    # The request span: gen_ai attributes and time to first token.
    attrs = _attrs(request)
    assert attrs["gen_ai.operation.name"] == "generate"
    assert attrs["gen_ai.request.model"] == demo_model_dir.name
    assert attrs["gen_ai.request.max_tokens"] == 8
    assert attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.usage.input_tokens"] == num_prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == 8
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    ttft = attrs["gen_ai.server.time_to_first_token"]
    assert isinstance(ttft, float) and 0 < ttft < 60
    assert any(event.name == "first token" for event in request.events)

    # One log line for the request, carrying the trace id.
    done = [line for line in serve.stderr_lines if " done: " in line]
    assert len(done) == 1 and f"trace_id={trace_id.hex()}" in done[0], done


def test_tracing_off_installs_nothing() -> None:
    args = argparse.Namespace(otlp_endpoint=None, trace_console=False)
    config = TracingConfig.from_args(args, {}, "decode")
    assert not config.is_enabled and config.service_name == "mili-decode"
    tracing = setup_tracing(config)
    assert tracing.provider is None
    assert tracing.server_interceptors() == [] and tracing.client_interceptors() == []
    tracing.shutdown()


def test_config_from_flags_and_environment() -> None:
    args = argparse.Namespace(otlp_endpoint=None, trace_console=False)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_SERVICE_NAME": "x"}
    config = TracingConfig.from_args(args, env, "frontend")
    assert (config.otlp_endpoint, config.service_name) == ("http://collector:4317", "x")
    flagged = argparse.Namespace(otlp_endpoint="http://flag:4317", trace_console=True)
    config = TracingConfig.from_args(flagged, env, "frontend")
    assert config.otlp_endpoint == "http://flag:4317" and config.is_console
    off = TracingConfig.from_args(flagged, {**env, "OTEL_SDK_DISABLED": "true"}, "frontend")
    assert not off.is_enabled


_DECODE_CALL = "mili.decode.v1.DecodeService/Generate"  # carried on GenerateStream


def test_failed_and_cut_calls_say_so_in_their_spans(
    demo_model_dir: Path, receiver: tuple[Receiver, int]
) -> None:
    """A refused call's span carries its exception once; a call its caller cancelled or let
    run past its deadline ends with that code on the frontend's spans, not as OK, and every
    span of its trace still ends (is exported)."""
    collector, port = receiver
    serve = ServiceProcess(
        "serve",
        "--model",
        str(demo_model_dir),
        "--port",
        "0",
        "--otlp-endpoint",
        f"http://127.0.0.1:{port}",
        "--decode-args",
        "--num-blocks 512 --block-size 16",
        timeout_s=180,
    )

    def request(request_id: str, **sampling: float) -> generation_pb2.GenerateRequest:
        return generation_pb2.GenerateRequest(
            request_id=request_id, prompt="Hello", sampling=sampling_pb2.SamplingParams(**sampling)
        )

    long = {"max_tokens": 4000, "temperature": 0, "ignore_eos": True}  # still running when cut
    try:
        with grpc.insecure_channel(serve.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(request("refused", temperature=-1), timeout=60))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as late:
                list(stub.Generate(request("late", **long), timeout=1.0))
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            stream = stub.Generate(request("cancelled", **long), timeout=60)
            next(stream)
            stream.cancel()
            deadline = time.monotonic() + 30
            while not any(
                "'cancelled'" in line and "CANCELLED" in line for line in serve.stderr_lines
            ):
                assert time.monotonic() < deadline, serve.stderr[-3000:]
                time.sleep(0.1)
    finally:
        code = serve.terminate(timeout_s=90)
    assert code == 0, serve.stderr[-3000:]

    deadline = time.monotonic() + 15
    while True:
        spans = collector.snapshot()
        names = {s.name for _, s in spans}
        if {"decode request", "kv transfer"} <= names or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    servers = [
        s
        for svc, s in spans
        if svc == "mili-frontend" and s.name == "/mili.frontend.v1.GenerationService/Generate"
    ]
    requests = {
        _attrs(s)["gen_ai.response.id"]: s
        for svc, s in spans
        if svc == "mili-frontend" and s.name == f"generate {demo_model_dir.name}"
    }
    assert set(requests) == {"late", "cancelled"}  # the refused one never got that far
    server_of = {
        name: _one([("f", s) for s in servers if s.trace_id == r.trace_id], "f", servers[0].name)
        for name, r in requests.items()
    }

    # The refused call: INVALID_ARGUMENT, its exception recorded once.
    (refused_span,) = [
        s for s in servers if s.trace_id not in {r.trace_id for r in requests.values()}
    ]
    assert _attrs(refused_span)["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert [e.name for e in refused_span.events] == ["exception"]

    error = trace_pb2.Status.STATUS_CODE_ERROR
    late_server, cancelled_server = server_of["late"], server_of["cancelled"]
    assert _attrs(late_server)["network.peer.address"] == "127.0.0.1"  # who called
    assert _attrs(late_server)["rpc.grpc.status_code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert late_server.status.code == error
    assert _attrs(cancelled_server)["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert requests["late"].status.code == error
    assert requests["late"].status.message.startswith("DEADLINE_EXCEEDED")
    assert requests["cancelled"].status.code == error
    assert requests["cancelled"].status.message.startswith("CANCELLED")
    # How far each got: at least the response the client read before cancelling.
    assert _attrs(requests["cancelled"])["gen_ai.usage.output_tokens"] >= 1
    assert "gen_ai.usage.output_tokens" in _attrs(requests["late"])
    for name, request_span in requests.items():
        in_trace = [(svc, s) for svc, s in spans if s.trace_id == request_span.trace_id]
        # The decode call, carried on the shared stream, says why it ended, not only how.
        (decode_call,) = [
            s for svc, s in in_trace if svc == "mili-frontend" and s.name == _DECODE_CALL
        ]
        assert decode_call.status.code == error, name
        code, _, why = decode_call.status.message.partition(": ")
        assert code in ("DEADLINE_EXCEEDED", "CANCELLED") and why, decode_call.status.message
        for service, span_name in [
            ("mili-tokenizer", "/mili.tokenizer.v1.TokenizerService/Tokenize"),
            ("mili-prefill", "kv transfer"),
            ("mili-decode", "decode request"),
        ]:
            assert _one(in_trace, service, span_name).end_time_unix_nano > 0, name
