"""Prometheus metrics of real services: `mili serve --metrics-port 0` starts the four services as
processes, each serving /metrics; one greedy generation moves every counter and histogram by
exactly what it did, and an invalid request is counted under its status. Without
--metrics-port a service listens on its gRPC port alone."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from mili.pb.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from mili.telemetry.metrics import MetricsServer
from tests.service_process import ServiceProcess

# A sample's name plus its labels, e.g. ("mili_requests_total", (("grpc_method", ...), ...)).
Key = tuple[str, tuple[tuple[str, str], ...]]
Samples = dict[Key, float]

_CHILD_METRICS = re.compile(r"^\[(\S+)\] \w+ metrics on (http://\S+)")
_PROMPT_TOKENS = 21  # two blocks of 16: one whole, one partial
_MAX_TOKENS = 8
_GENERATE = "/mili.frontend.v1.GenerationService/Generate"
_ITEM_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def rpc(path: str) -> dict[str, str]:
    """The grpc_service and grpc_method labels of `/pkg.Service/Method`."""
    service, method = path.removeprefix("/").split("/")
    return {"grpc_service": service, "grpc_method": method}


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; 0 for a labelled counter not created yet."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.fixture(scope="module")
def serve(demo_model_dir: Path) -> Iterator[tuple[ServiceProcess, dict[str, str]]]:
    """`mili serve` with every child's metrics on a free port; yields it and child -> URL."""
    service = ServiceProcess(
        "serve",
        "--model",
        str(demo_model_dir),
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--prefill-args",
        "--num-blocks 64",
        "--decode-args",
        "--num-blocks 64",
        timeout_s=180,
    )
    try:
        urls: dict[str, str] = {}
        # The children's lines reach the launcher's stderr before its own listening line.
        for _ in range(100):
            urls = {
                m.group(1): m.group(2)
                for line in list(service.stderr_lines)
                if (m := _CHILD_METRICS.match(line))
            }
            if len(urls) == 4:
                break
            time.sleep(0.05)
        assert set(urls) == {"frontend", "tokenizer", "prefill-0", "decode-0"}, service.stderr
        yield service, urls
    finally:
        assert service.terminate(timeout_s=90) == 0, service.stderr[-3000:]


def test_one_generation_moves_every_metric_by_what_it_did(
    serve: tuple[ServiceProcess, dict[str, str]],
) -> None:
    service, urls = serve
    with grpc.insecure_channel(service.address) as channel:
        frontend = generation_pb2_grpc.GenerationServiceStub(channel)
        info = frontend.Info(generation_pb2.InfoRequest(), timeout=30)
        with grpc.insecure_channel(info.prefill_addresses[0]) as prefill_channel:
            prefill = prefill_pb2_grpc.PrefillServiceStub(prefill_channel)
            layout = prefill.Info(prefill_pb2.InfoRequest(), timeout=30).kv_layout
        before = {name: scrape(url) for name, url in urls.items()}
        responses = list(
            frontend.Generate(
                generation_pb2.GenerateRequest(
                    token_ids=list(range(1, _PROMPT_TOKENS + 1)),
                    sampling=sampling_pb2.SamplingParams(
                        max_tokens=_MAX_TOKENS, temperature=0, ignore_eos=True
                    ),
                ),
                timeout=60,
            )
        )
    assert responses[-1].usage.completion_tokens == _MAX_TOKENS

    def after_settled() -> bool:  # prefill frees its blocks after decode's ack, in parallel
        after.update({name: scrape(url) for name, url in urls.items()})
        return all(
            value(after[name], f"mili_{kind}_kv_blocks_free")
            == value(after[name], f"mili_{kind}_kv_blocks_capacity")
            for name, kind in (("prefill-0", "prefill"), ("decode-0", "decode"))
        ) and value(
            after["prefill-0"],
            "mili_requests_total",
            **rpc("/mili.prefill.v1.PrefillService/Prefill"),
            status="OK",
        ) > value(
            before["prefill-0"],
            "mili_requests_total",
            **rpc("/mili.prefill.v1.PrefillService/Prefill"),
            status="OK",
        )

    after: dict[str, Samples] = {}
    wait_until(after_settled)

    def moved(child: str, name: str, **labels: str) -> float:
        return value(after[child], name, **labels) - value(before[child], name, **labels)

    # Requests by method and status, on each service.
    assert moved("frontend", "mili_requests_total", **rpc(_GENERATE), status="OK") == 1
    assert (
        moved("frontend", "mili_requests_total", **rpc(_GENERATE), status="INVALID_ARGUMENT") == 0
    )
    tokenize = "/mili.tokenizer.v1.TokenizerService/Tokenize"
    assert moved("tokenizer", "mili_requests_total", **rpc(tokenize), status="OK") == 0  # ids given
    prefill_rpc = "/mili.prefill.v1.PrefillService/Prefill"
    assert moved("prefill-0", "mili_requests_total", **rpc(prefill_rpc), status="OK") == 1
    decode_rpc = "/mili.decode.v1.DecodeService/Generate"
    assert moved("decode-0", "mili_requests_total", **rpc(decode_rpc), status="OK") == 1
    transfer_rpc = "/mili.kv.v1.KvTransferService/TransferKv"
    assert moved("decode-0", "mili_requests_total", **rpc(transfer_rpc), status="OK") == 1

    # The frontend's Info polling of prefill and decode (and our own Info calls) is control
    # traffic: counted apart, never in mili_requests_total.
    for child in ("frontend", "tokenizer", "prefill-0", "decode-0"):
        traffic = [labels for name, labels in after[child] if name == "mili_requests_total"]
        assert not [labels for labels in traffic if ("grpc_method", "Info") in labels], child
    for child, service in (
        ("prefill-0", "prefill.v1.PrefillService"),
        ("decode-0", "decode.v1.DecodeService"),
    ):
        polls = value(
            after[child], "mili_control_requests_total", **rpc(f"/mili.{service}/Info"), status="OK"
        )
        assert polls > 0, child

    # Tokens in and streamed to the client; nothing left in flight.
    assert moved("frontend", "mili_frontend_prompt_tokens_total") == _PROMPT_TOKENS
    assert moved("frontend", "mili_frontend_generated_tokens_total") == _MAX_TOKENS
    assert value(after["frontend"], "mili_frontend_in_flight_requests") == 0

    # Every service's process metrics (Linux: read from /proc).
    if sys.platform.startswith("linux"):
        for child in ("frontend", "tokenizer", "prefill-0", "decode-0"):
            assert value(after[child], "process_resident_memory_bytes") > 10 * 2**20, child
            assert value(after[child], "process_cpu_seconds_total") > 0, child
            assert value(after[child], "process_open_fds") > 3, child

    # Frontend latencies: one request, one first token, 8 tokens -> one time-per-output-token.
    ttft = "mili_frontend_time_to_first_token_seconds"
    assert moved("frontend", f"{ttft}_count") == 1
    assert moved("frontend", f"{ttft}_sum") > 0
    tpot = "mili_frontend_time_per_output_token_seconds"
    assert moved("frontend", f"{tpot}_count") == 1
    assert moved("frontend", f"{tpot}_sum") > 0
    # Its end: a whole answer cut by max_tokens, its latency and lengths.
    assert moved("frontend", "mili_frontend_requests_finished_total", outcome="length") == 1
    assert moved("frontend", "mili_frontend_request_duration_seconds_count") == 1
    assert moved("frontend", "mili_frontend_request_output_tokens_sum") == _MAX_TOKENS
    assert moved("frontend", "mili_frontend_request_prompt_tokens_sum") == _PROMPT_TOKENS

    # Prefill: the 21-token prompt in one forward of one chunk.
    assert moved("prefill-0", "mili_prefill_tokens_total") == _PROMPT_TOKENS
    assert moved("prefill-0", "mili_prefill_batch_tokens_count") == 1
    assert moved("prefill-0", "mili_prefill_batch_tokens_sum") == _PROMPT_TOKENS
    assert moved("prefill-0", "mili_prefill_batch_size_sum") == 1
    assert moved("prefill-0", "mili_prefill_step_seconds_count") == 1
    assert moved("prefill-0", "mili_prefill_step_seconds_sum") > 0

    # KV: every layer's K and V of the prompt's blocks, sent once and received once.
    num_blocks = -(-_PROMPT_TOKENS // layout.block_size)
    block_bytes = (
        layout.block_size * layout.num_kv_heads * layout.head_dim * _ITEM_SIZES[layout.dtype]
    )
    kv_bytes = layout.num_layers * num_blocks * 2 * block_bytes
    assert moved("prefill-0", "mili_prefill_kv_sent_bytes_total") == kv_bytes
    assert moved("decode-0", "mili_decode_kv_received_bytes_total") == kv_bytes
    assert moved("prefill-0", "mili_prefill_kv_transfer_seconds_count") == 1
    assert moved("decode-0", "mili_decode_kv_transfer_seconds_count") == 1

    # Decode: prefill sampled the first token, so 7 steps of a batch of one made the rest.
    assert moved("decode-0", "mili_decode_step_seconds_count") == _MAX_TOKENS - 1
    assert moved("decode-0", "mili_decode_batch_size_sum") == _MAX_TOKENS - 1

    # Gauges back at rest: every block free, nothing queued, waiting or running.
    for child, kind in (("prefill-0", "prefill"), ("decode-0", "decode")):
        assert value(after[child], f"mili_{kind}_kv_blocks_capacity") == 64
        assert value(after[child], f"mili_{kind}_kv_blocks_free") == 64
        assert value(after[child], f"mili_{kind}_kv_blocks_used") == 0
    assert value(after["prefill-0"], "mili_prefill_queued_tokens") == 0
    assert value(after["prefill-0"], "mili_prefill_queued_requests") == 0
    assert value(after["prefill-0"], "mili_prefill_waiting_requests") == 0
    assert value(after["decode-0"], "mili_decode_waiting_requests") == 0
    assert value(after["decode-0"], "mili_decode_running_requests") == 0


def test_every_service_s_metrics_follow_prometheus_naming(
    serve: tuple[ServiceProcess, dict[str, str]],
) -> None:
    """Found by `promtool check metrics` on each /metrics: prefill's and decode's pool size was
    a gauge named `..._kv_blocks_total`, a counter's suffix. What promtool checks, here without
    it (and promtool too where it is installed): help text on every family, `_total` on
    counters only, units spelled out; no label that grows with traffic (ids)."""
    _, urls = serve
    for child, url in urls.items():
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            name = family.name
            assert family.documentation, f"{child}: {name} has no help text"
            if family.type == "gauge" and not name.endswith("_created"):
                assert not name.endswith("_total"), f"{child}: gauge {name} ends in _total"
            assert not re.search(r"_(ms|millis|milliseconds|kb|mb|gb|bits)(_|$)", name), name
            for sample in family.samples:
                assert not {"request_id", "id", "trace_id", "prompt"} & set(sample.labels), (
                    f"{child}: {sample.name} labelled {sample.labels}"
                )
        promtool = shutil.which("promtool")
        if promtool is not None:
            checked = subprocess.run(
                [promtool, "check", "metrics"], input=text, capture_output=True, text=True
            )
            assert checked.returncode == 0, f"{child}: {checked.stdout}{checked.stderr}"


def test_a_refused_request_is_counted_under_its_status(
    serve: tuple[ServiceProcess, dict[str, str]],
) -> None:
    service, urls = serve
    before = scrape(urls["frontend"])
    with grpc.insecure_channel(service.address) as channel:
        frontend = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(
                frontend.Generate(
                    generation_pb2.GenerateRequest(
                        token_ids=[1, 2, 3],
                        sampling=sampling_pb2.SamplingParams(max_tokens=4, temperature=-1),
                    ),
                    timeout=30,
                )
            )
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(urls["frontend"])
    bad = dict(**rpc(_GENERATE), status="INVALID_ARGUMENT")
    assert (
        value(after, "mili_requests_total", **bad) - value(before, "mili_requests_total", **bad)
        == 1
    )
    ok = dict(**rpc(_GENERATE), status="OK")
    assert value(after, "mili_requests_total", **ok) == value(before, "mili_requests_total", **ok)
    ttft = "mili_frontend_time_to_first_token_seconds_count"
    assert value(after, ttft) == value(before, ttft)


def _listening_ports(pid: int) -> set[int]:
    """TCP ports process `pid` listens on (Linux: its socket inodes in /proc/PID/net/tcp*)."""
    fds = Path(f"/proc/{pid}/fd")
    inodes = set()
    for fd in fds.iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("with_metrics", [False, True])
def test_metrics_listen_only_when_asked(demo_model_dir: Path, with_metrics: bool) -> None:
    flags = ["--metrics-port", "0"] if with_metrics else []
    service = ServiceProcess(
        "serve-tokenizer", "--model", str(demo_model_dir), "--port", "0", *flags
    )
    try:
        grpc_port = int(service.address.rsplit(":", 1)[1])
        ports = _listening_ports(service.proc.pid)
        assert grpc_port in ports
        if not with_metrics:
            assert ports == {grpc_port}
            return
        (metrics_port,) = ports - {grpc_port}
        samples = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
        # Health checks are infrastructure: not counted, so nothing was yet.
        assert not any(name == "mili_requests_total" for name, _ in samples)
    finally:
        assert service.terminate() == 0, service.stderr


def test_head_is_answered_as_get_without_the_body() -> None:
    """aiperf's --server-metrics probe (aiohttp, one session): HEAD, then GET only where HEAD
    did not answer 200. prometheus_client answered HEAD with a 405 and a body, which aiohttp
    rejects as a broken response ("Data after `Connection: close`"), so aiperf dropped every
    MILI metrics endpoint it was given."""
    registry = CollectorRegistry()
    Counter("mili_probes", "HEAD probes", registry=registry).inc()
    server = MetricsServer(registry, "127.0.0.1", 0)

    async def probe() -> tuple[int, bytes, str, str, bytes]:
        async with aiohttp.ClientSession() as session:
            async with session.head(server.url, allow_redirects=False) as head:
                status, head_body = head.status, await head.read()
                length = head.headers["Content-Length"]
            async with session.get(server.url) as get:
                return status, head_body, length, get.headers["Content-Length"], await get.read()

    try:
        status, head_body, head_length, get_length, body = asyncio.run(probe())
    finally:
        server.close()
    assert (status, head_body, head_length) == (200, b"", get_length)
    assert b"mili_probes_total 1.0" in body
