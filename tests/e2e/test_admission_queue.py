"""Load past decode's --max-running and prefill's --max-queued-tokens waits in the frontend's
admission queue instead of failing: `mili bench` against `mili serve` (demo model) with small
limits finishes every request, and the frontend's metrics show the waits (issue 29)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from tests.service_process import ROOT, ServiceProcess


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text: str = reply.read().decode()
    return text


def _sample(metrics: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", metrics, re.MULTILINE)
    assert match is not None, f"{name} not in the metrics"
    return float(match.group(1))


def _short_deadline_call(address: str) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(
            token_ids=list(range(40, 56)),
            sampling=sampling_pb2.SamplingParams(max_tokens=64, ignore_eos=True),
        )
        try:
            list(stub.Generate(request, timeout=0.5))
        except grpc.RpcError as err:
            code: grpc.StatusCode = err.code()
            return code
    return grpc.StatusCode.OK


def test_load_past_every_limit_waits_and_finishes(demo_model_dir: Path, tmp_path: Path) -> None:
    serve = ServiceProcess(
        "serve", "--model", str(demo_model_dir), "--port", "0", "--metrics-port", "0",
        # Decode: 4 running requests, 10 blocks of 16 tokens; prefill: 2 prompts of 16 tokens
        # queued at once.
        "--decode-args", "--num-blocks 10 --max-running 4",
        "--prefill-args", "--num-blocks 256 --max-queued-tokens 40",
        timeout_s=180,
    )  # fmt: skip
    try:
        summary = "".join(serve.stdout_lines)
        urls = dict(re.findall(r"mili serve: (\S+)\s.*metrics (\S+)", summary))
        assert {"frontend", "prefill-0", "decode-0"} <= set(urls), summary
        # 16 + 8 tokens hold 2 blocks: --max-running bounds decode (4 x 2 of 10 blocks);
        # 16 + 40 tokens hold 4: its blocks do (2 at once, below --max-running).
        for output_tokens in (8, 40):
            out = tmp_path / f"bench-{output_tokens}.json"
            bench = subprocess.run(
                [sys.executable, "-m", "mili", "bench", "--address", serve.address,
                 "--concurrency", "32", "--num-requests", "64", "--prompt-tokens", "16",
                 "--output-tokens", str(output_tokens), "--json", str(out)],
                cwd=ROOT, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert bench.returncode == 0, bench.stdout + bench.stderr
            result = json.loads(out.read_text())
            assert (result["num_ok"], result["num_errors"]) == (64, 0), result["errors"]
        metrics = _metrics(urls["frontend"])
        assert _sample(metrics, "mili_frontend_queue_wait_seconds_count") > 0
        assert _sample(metrics, "mili_frontend_queue_wait_seconds_sum") > 0
        assert _sample(metrics, "mili_frontend_queued_requests") == 0  # all through
        # Prefill turned some away (its queue was full): they waited and went through too.
        refused = [
            sample.value
            for family in text_string_to_metric_families(_metrics(urls["prefill-0"]))
            for sample in family.samples
            if sample.name == "mili_requests_total"
            and sample.labels["grpc_method"] == "Prefill"
            and sample.labels["status"] == "RESOURCE_EXHAUSTED"
        ]
        assert refused and refused[0] > 0

        # Deadlines passing, many of them while queued: nothing is left reserved on decode.
        with ThreadPoolExecutor(max_workers=16) as pool:
            codes = list(pool.map(_short_deadline_call, [serve.address] * 16))
        assert grpc.StatusCode.DEADLINE_EXCEEDED in codes, codes
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}, codes
        deadline = time.monotonic() + 30
        while True:
            decode = _metrics(urls["decode-0"])
            frontend = _metrics(urls["frontend"])
            free = _sample(decode, "mili_decode_kv_blocks_free")
            is_idle = (
                free == _sample(decode, "mili_decode_kv_blocks_capacity")
                and _sample(decode, "mili_decode_waiting_requests") == 0
                and _sample(decode, "mili_decode_running_requests") == 0
                and _sample(frontend, "mili_frontend_queued_requests") == 0
                and _sample(frontend, "mili_frontend_in_flight_requests") == 0
            )
            if is_idle:
                break
            assert time.monotonic() < deadline, f"decode holds blocks: {free} free\n{decode}"
            time.sleep(0.2)
    finally:
        code = serve.terminate(timeout_s=90)
    assert code == 0, serve.stderr[-3000:]
    assert "Traceback" not in serve.stderr, serve.stderr[-3000:]


def test_a_lower_priority_number_is_admitted_first(demo_model_dir: Path) -> None:
    """Decode runs one request at a time: while it runs, two requests of priority 0 queue
    (gRPC), then one of priority -1 (HTTP, vLLM's `priority`); the running one is cancelled,
    and the -1 is admitted first, then the others in arrival order."""
    serve = ServiceProcess(
        "serve", "--model", str(demo_model_dir), "--port", "0", "--metrics-port", "0",
        "--http-port", "0", "--decode-args", "--max-running 1",
        timeout_s=180,
    )  # fmt: skip
    finished: list[str] = []

    def grpc_call(name: str) -> None:
        with grpc.insecure_channel(serve.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            request = generation_pb2.CompleteRequest(
                token_ids=list(range(40, 56)),
                sampling=sampling_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
            )
            stub.Complete(request, timeout=60)
        finished.append(name)

    def http_call(name: str, priority: int) -> None:
        body = {"prompt": [40, 41, 42], "max_tokens": 4, "ignore_eos": True, "priority": priority}
        request = urllib.request.Request(
            f"{serve.http_url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert reply.status == 200
        finished.append(name)

    try:
        summary = "".join(serve.stdout_lines)
        frontend_metrics = dict(re.findall(r"mili serve: (\S+)\s.*metrics (\S+)", summary))[
            "frontend"
        ]

        def queued() -> float:
            return _sample(_metrics(frontend_metrics), "mili_frontend_queued_requests")

        def wait_queued(n: int) -> None:
            deadline = time.monotonic() + 30
            while queued() < n:
                assert time.monotonic() < deadline, f"{queued()} queued, not {n}"
                time.sleep(0.05)

        with grpc.insecure_channel(serve.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            running = stub.Generate(
                generation_pb2.GenerateRequest(
                    token_ids=list(range(60, 76)),
                    sampling=sampling_pb2.SamplingParams(max_tokens=4000, ignore_eos=True),
                ),
                timeout=120,
            )
            next(running)  # decoding: decode's one place is taken
            with ThreadPoolExecutor(max_workers=3) as pool:
                calls = [pool.submit(grpc_call, "first")]
                wait_queued(1)
                calls.append(pool.submit(grpc_call, "second"))
                wait_queued(2)
                calls.append(pool.submit(http_call, "urgent", -1))
                wait_queued(3)
                running.cancel()
                for call in calls:
                    call.result(timeout=60)
        assert finished == ["urgent", "first", "second"]
    finally:
        code = serve.terminate(timeout_s=90)
    assert code == 0, serve.stderr[-3000:]
